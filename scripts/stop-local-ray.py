"""Stop routerd's own local Ray head (``make stop``): SIGTERM, then wait until its GCS port closes.

Ray drains for up to 30 s on SIGTERM before its processes exit, and the detached engines go with it;
waiting here means a following ``make run`` starts a fresh head instead of finding a dying one.
"""

import contextlib
import json
import os
import signal
import socket
import sys
import time

path = sys.argv[1] if len(sys.argv) > 1 else ".routerd/ray/head.json"
try:
    with open(path) as f:
        head = json.load(f)
except FileNotFoundError:
    sys.exit(0)


def port_open() -> bool:
    try:
        with socket.create_connection((head["host"], head["port"]), timeout=0.5):
            return True
    except OSError:
        return False


with contextlib.suppress(ProcessLookupError):
    os.kill(head["pid"], signal.SIGTERM)
deadline = time.monotonic() + 60
while port_open() and time.monotonic() < deadline:
    time.sleep(0.5)
print(f"stopped the local Ray head (pid {head['pid']}) and the engines it held"
      if not port_open() else "the local Ray head is still shutting down")
