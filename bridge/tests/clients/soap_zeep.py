"""Submits messages to the engine through zeep, a SOAP client that builds itself from the WSDL.

usage: soap_zeep.py WSDL_URL BINDING MESSAGES.json [CA_FILE [CERT_FILE KEY_FILE]]
  BINDING: STESoap11 or STESoap12
  CA_FILE: for https, the CA to trust; CERT_FILE and KEY_FILE: a client certificate
  MESSAGES.json: a list of {"signer", "key_hex", "xml", "forge"}; the signature is the hex
  HMAC-SHA256 of the message bytes under the signer's key (inverted when "forge" is true).
Prints a JSON list: the Status of each answer, or "FAULT <faultstring>".
"""

import hashlib
import hmac
import json
import sys

from requests import Session
from zeep import Client
from zeep.transports import Transport
from zeep.exceptions import Fault


def main():
    url, binding, path = sys.argv[1:4]
    with open(path, encoding="utf-8") as f:
        messages = json.load(f)
    session = Session()
    if len(sys.argv) > 4:
        # The given CA, not one that REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE would put first.
        session.trust_env = False
        session.verify = sys.argv[4]
    if len(sys.argv) > 6:
        session.cert = (sys.argv[5], sys.argv[6])
    client = Client(url, transport=Transport(session=session))
    service = client.bind("STE", binding)
    answers = []
    for m in messages:
        body = m["xml"].encode("utf-8")
        signature = hmac.new(bytes.fromhex(m["key_hex"]), body, hashlib.sha256).digest()
        if m.get("forge"):
            signature = bytes(b ^ 0xFF for b in signature)
        try:
            status = service.Submit(
                Message=body,
                _soapheaders={"Auth": {"Participant": m["signer"], "Signature": signature.hex()}},
            )
            answers.append(str(status))
        except Fault as fault:
            answers.append("FAULT " + str(fault.message))
    print(json.dumps(answers))


if __name__ == "__main__":
    main()
