"""A FIX 4.4 participant built on simplefix (a FIX library from PyPI), against the engine.

usage: fix_simplefix.py SCENARIO.json
SCENARIO: {"host", "port", "participant", "key_hex", "mode", "messages": [[[tag, value], ...], ...],
           "signers": [key_hex per message, optional], "cls": N,
           "tls": {"ca", "cert", "key"} (optional: TLS, trusting the CA file; cert and key, when
           given, are the client certificate)}
  mode "trade":   log on, send every message (signed), collect every answer and N pushed CLS,
                  answer TestRequests, log out.
  mode "gap":     log on, send message 1 as MsgSeqNum 2, skip 3, send message 2 as 4; expect a
                  ResendRequest for 3, send message 3 as 3 (PossDupFlag), collect the answers.
  mode "badpass": log on with a wrong password; expect a Logout.
Prints a JSON object: answers [[MsgType, id, status, text]], cls, resend_request [begin, end],
logout_text.
"""

import datetime
import hashlib
import hmac
import json
import socket
import ssl
import sys

import simplefix

SOH = b"\x01"


def now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H:%M:%S.%f")[:-3]


class Session:
    def __init__(self, spec):
        self.spec = spec
        self.sock = socket.create_connection((spec["host"], spec["port"]), timeout=30)
        tls = spec.get("tls")
        if tls is not None:
            context = ssl.create_default_context(cafile=tls["ca"])
            if tls.get("cert"):
                context.load_cert_chain(tls["cert"], tls["key"])
            self.sock = context.wrap_socket(self.sock, server_hostname="localhost")
        self.parser = simplefix.FixParser()
        self.seq = 1
        self.me = spec["participant"]

    def send(self, pairs, seq=None, poss_dup=False, key_hex=None, sender=None):
        """pairs: body fields from 35 on (35 first). Signed when key_hex is given."""
        seq = self.seq if seq is None else seq
        msg_type, body = pairs[0], pairs[1:]
        fields = [msg_type, (49, sender or self.me), (56, "STE"), (34, str(seq)), (52, now())]
        if poss_dup:
            fields += [(43, "Y"), (122, now())]
        fields += [tuple(p) for p in body]
        if key_hex is not None:
            covered = b"".join(b"%d=%s\x01" % (int(t), str(v).encode()) for t, v in fields)
            signature = hmac.new(bytes.fromhex(key_hex), covered, hashlib.sha256).hexdigest()
            fields += [(93, str(len(signature))), (89, signature)]
        message = simplefix.FixMessage()
        message.append_pair(8, "FIX.4.4")
        for tag, value in fields:
            message.append_pair(int(tag), str(value))
        self.sock.sendall(message.encode())
        if seq >= self.seq:
            self.seq = seq + 1

    def receive(self):
        while True:
            message = self.parser.get_message()
            if message is not None:
                return message
            data = self.sock.recv(65536)
            if not data:
                return None
            self.parser.append_buffer(data)

    def logon(self, password=None):
        sending_time = now()
        if password is None:
            covered = b"STE-FIX-LOGON\x00" + sending_time.encode() + self.me.encode()
            password = hmac.new(bytes.fromhex(self.spec["key_hex"]), covered, hashlib.sha256).hexdigest()
        message = simplefix.FixMessage()
        message.append_pair(8, "FIX.4.4")
        for tag, value in [(35, "A"), (49, self.me), (56, "STE"), (34, "1"), (52, sending_time),
                           (98, "0"), (108, "5"), (141, "Y"), (553, self.me), (554, password)]:
            message.append_pair(tag, value)
        self.sock.sendall(message.encode())
        self.seq = 2
        return self.receive()


def text(message, tag):
    value = message.get(tag)
    return value.decode() if value is not None else None


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    session = Session(spec)
    result = {"answers": [], "cls": 0, "resend_request": None, "logout_text": None}
    if spec["mode"] == "badpass":
        answer = session.logon(password="00" * 32)
        result["logout_text"] = text(answer, 58) if answer is not None and text(answer, 35) == "5" else None
        print(json.dumps(result))
        return
    answer = session.logon()
    assert answer is not None and text(answer, 35) == "A", answer
    messages = spec["messages"]
    signers = spec.get("signers") or [spec["key_hex"]] * len(messages)
    senders = spec.get("senders") or [None] * len(messages)
    if spec["mode"] == "gap":
        session.send(messages[0], seq=2, key_hex=signers[0])
        session.send(messages[1], seq=4, key_hex=signers[1])
    else:
        for pairs, key_hex, sender in zip(messages, signers, senders):
            session.send(pairs, key_hex=key_hex, sender=sender)
    expected_answers = len(messages)
    while len(result["answers"]) < expected_answers or result["cls"] < spec.get("cls", 0):
        message = session.receive()
        if message is None:
            break
        msg_type = text(message, 35)
        if msg_type in ("AR", "P", "AU"):
            ident = text(message, {"AR": 571, "P": 70, "AU": 664}[msg_type])
            status = text(message, {"AR": 751, "P": 87, "AU": 940}[msg_type])
            result["answers"].append([msg_type, ident, status, text(message, 58)])
        elif msg_type == "n" and text(message, 213).startswith("<Cls"):
            result["cls"] += 1
        elif msg_type == "1":
            session.send([(35, "0"), (112, text(message, 112))])
        elif msg_type == "2":
            result["resend_request"] = [int(text(message, 7)), int(text(message, 16))]
            session.send(messages[2], seq=3, poss_dup=True, key_hex=signers[2])
        elif msg_type == "5":
            result["logout_text"] = text(message, 58)
            break
    session.send([(35, "5")])
    while True:
        message = session.receive()
        if message is None or text(message, 35) == "5":
            break
    print(json.dumps(result))


if __name__ == "__main__":
    main()
