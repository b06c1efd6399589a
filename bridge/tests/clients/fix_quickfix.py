"""Participants' FIX gateways built on QuickFIX (PyPI `quickfix`, the C++ engine), against the
engine: one SocketInitiator with a session per participant, validating every message it reads
against a FIX 4.4 data dictionary (UseDataDictionary=Y, QuickFIX's default validation), keeping
its sequence numbers and sent messages in a FileStore, never resetting them on its own.

usage: fix_quickfix.py SCENARIO.json
SCENARIO: {"host", "port", "dictionary": path, "dir": work folder (store, logs),
           "heartbeat": seconds, "timeout": seconds,
           "sessions": [{"participant", "key_hex"}],
           "runs": [{"messages": [[participant, [[tag, value], ...]], ...],
                     "expect": {participant: {"answers": N, "cls": N}}}]}
Each run starts the initiator (the same FileStore: a later run is a reconnect), logs every
session on, sends its messages in order (each signed in toApp, so that a resend is signed too),
waits until every session has its answers and CLS, then logs out and stops.
The application messages are given as the fields of STE's mapping, groups inline; each is read
with the dictionary into a QuickFIX message, so QuickFIX builds its groups.
Prints a JSON object per participant: answers [[MsgType, id, status, text, possdup]],
cls [[ClsId, possdup]], rejects_received / rejects_sent ([MsgType, RefSeqNum, reason, text]),
resend_requests_sent [[begin, end]], resent (ids of application messages QuickFIX sent again),
logons [[run, MsgSeqNum sent, ResetSeqNumFlag sent]].
"""

import datetime
import faulthandler
import hashlib
import hmac
import json
import os
import sys
import threading
import time

import quickfix as fix

SOH = "\x01"


def field(message, tag, header=False):
    holder = message.getHeader() if header else message
    return holder.getField(tag) if holder.isSetField(tag) else None


def encode(pairs):
    body = "".join(f"{tag}={value}{SOH}" for tag, value in pairs)
    head = f"8=FIX.4.4{SOH}9={len(body)}{SOH}"
    checksum = sum((head + body).encode()) % 256
    return f"{head}{body}10={checksum:03d}{SOH}"


class Participants(fix.Application):
    def __init__(self, spec):
        super().__init__()
        self.keys = {s["participant"]: bytes.fromhex(s["key_hex"]) for s in spec["sessions"]}
        self.lock = threading.Lock()
        self.run = 0
        self.logged_on = set()
        self.result = {
            p: {"answers": [], "cls": [], "rejects_received": [], "rejects_sent": [],
                "resend_requests_sent": [], "resent": [], "logons": [], "advices": []}
            for p in self.keys
        }

    def onCreate(self, sessionID):
        pass

    def onLogon(self, sessionID):
        with self.lock:
            self.logged_on.add(sessionID.getSenderCompID().getValue())

    def onLogout(self, sessionID):
        with self.lock:
            self.logged_on.discard(sessionID.getSenderCompID().getValue())

    def toAdmin(self, message, sessionID):
        me = sessionID.getSenderCompID().getValue()
        msg_type = field(message, 35, header=True)
        with self.lock:
            mine = self.result[me]
            if msg_type == "A":
                sending_time = field(message, 52, header=True)
                covered = b"STE-FIX-LOGON\x00" + sending_time.encode() + me.encode()
                message.setField(553, me)
                message.setField(554, hmac.new(self.keys[me], covered, hashlib.sha256).hexdigest())
                mine["logons"].append([self.run, int(field(message, 34, header=True)),
                                       field(message, 141)])
            elif msg_type == "2":
                mine["resend_requests_sent"].append([int(field(message, 7)), int(field(message, 16))])
            elif msg_type == "3":
                mine["rejects_sent"].append(["3", field(message, 45), field(message, 373),
                                             field(message, 58)])

    def fromAdmin(self, message, sessionID):
        me = sessionID.getSenderCompID().getValue()
        if field(message, 35, header=True) == "3":
            with self.lock:
                self.result[me]["rejects_received"].append(
                    ["3", field(message, 45), field(message, 373), field(message, 58)])

    def toApp(self, message, sessionID):
        me = sessionID.getSenderCompID().getValue()
        msg_type = field(message, 35, header=True)
        if msg_type == "j":
            with self.lock:
                self.result[me]["rejects_sent"].append(["j", field(message, 45), field(message, 380),
                                                        field(message, 58)])
            return
        if field(message, 43, header=True) == "Y":
            ident = {"AE": 571, "J": 70, "T": 777}.get(msg_type)
            with self.lock:
                self.result[me]["resent"].append(field(message, ident) if ident else msg_type)
        # The signature covers every byte from 35= up to 93=, header included: signed here,
        # after QuickFIX has filled the header, on first sending and on every resend.
        trailer = message.getTrailer()
        trailer.setField(93, "64")
        trailer.setField(89, "0" * 64)
        text = message.toString()
        covered = text[text.index(SOH + "35=") + 1:text.index(SOH + "93=") + 1]
        trailer.setField(89, hmac.new(self.keys[me], covered.encode(), hashlib.sha256).hexdigest())

    def fromApp(self, message, sessionID):
        me = sessionID.getSenderCompID().getValue()
        msg_type = field(message, 35, header=True)
        possdup = field(message, 43, header=True) == "Y"
        with self.lock:
            mine = self.result[me]
            if msg_type in ("AR", "P", "AU"):
                ident = field(message, {"AR": 571, "P": 70, "AU": 664}[msg_type])
                status = field(message, {"AR": 751, "P": 87, "AU": 940}[msg_type])
                mine["answers"].append([msg_type, ident, status, field(message, 58), possdup])
            elif msg_type == "n":
                xml = field(message, 213, header=True) or ""
                if xml.startswith("<Cls"):
                    cls_id = xml.split("<ClsId>", 1)[1].split("</ClsId>", 1)[0]
                    mine["cls"].append([cls_id, possdup])
                else:
                    mine["advices"].append(xml)
            elif msg_type == "j":
                mine["rejects_received"].append(["j", field(message, 45), field(message, 380),
                                                 field(message, 58)])


def settings_for(spec):
    # A 24-hour session whose daily reset is twelve hours away, so that no run meets it.
    reset = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=12)).strftime("%H:%M:%S")
    lines = [
        "[DEFAULT]",
        "ConnectionType=initiator",
        "BeginString=FIX.4.4",
        "TargetCompID=STE",
        f"SocketConnectHost={spec['host']}",
        f"SocketConnectPort={spec['port']}",
        f"HeartBtInt={spec['heartbeat']}",
        "ReconnectInterval=1",
        f"FileStorePath={os.path.join(spec['dir'], 'store')}",
        f"FileLogPath={os.path.join(spec['dir'], 'log')}",
        f"StartTime={reset}",
        f"EndTime={reset}",
        "UseDataDictionary=Y",
        f"DataDictionary={spec['dictionary']}",
        "ResetOnLogon=N",
        "ResetOnLogout=N",
        "ResetOnDisconnect=N",
    ]
    for session in spec["sessions"]:
        lines += ["[SESSION]", f"SenderCompID={session['participant']}"]
    path = os.path.join(spec["dir"], "session.cfg")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return fix.SessionSettings(path)


def wait_until(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def main():
    faulthandler.enable()  # a crash inside the C++ engine still says where it happened
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    dictionary = fix.DataDictionary(spec["dictionary"])
    app = Participants(spec)
    settings = settings_for(spec)
    timeout = spec.get("timeout", 60)
    session_of = {p: fix.SessionID("FIX.4.4", p, "STE") for p in app.keys}
    error = None
    try:
        for run, plan in enumerate(spec["runs"]):
            app.run = run
            before = {p: (len(r["answers"]), len(r["cls"])) for p, r in app.result.items()}
            # An initiator uses its factories until it is destroyed and holds no Python reference
            # to them: they are let go only after it (below). Its sessions stay registered
            # under their SessionIDs until it is destroyed, so each run's goes before the next.
            store, logs = fix.FileStoreFactory(settings), fix.FileLogFactory(settings)
            initiator = fix.SocketInitiator(app, store, settings, logs)
            initiator.start()
            try:
                wait_until(lambda: len(app.logged_on) == len(app.keys), timeout, "logons")
                for participant, pairs in plan["messages"]:
                    header = [pairs[0], (49, participant), (56, "STE"), (34, 1),
                              (52, "20000101-00:00:00.000")]
                    message = fix.Message(encode(header + [tuple(p) for p in pairs[1:]]),
                                          dictionary, False)
                    if not fix.Session.sendToTarget(message, session_of[participant]):
                        raise RuntimeError(f"QuickFIX did not send {pairs[:3]}")

                def complete():
                    with app.lock:
                        return all(
                            len(app.result[p]["answers"]) - before[p][0] >= want.get("answers", 0)
                            and len(app.result[p]["cls"]) - before[p][1] >= want.get("cls", 0)
                            for p, want in plan["expect"].items())
                wait_until(complete, timeout, f"answers and CLS of run {run}")
            finally:
                initiator.stop()
                del initiator
    except Exception as problem:  # reported with what was seen so far
        error = repr(problem)
    with app.lock:
        print(json.dumps({"participants": app.result, "error": error}))


if __name__ == "__main__":
    main()
