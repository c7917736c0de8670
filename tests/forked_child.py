"""A program for tests/test_forkserver.py to fork: `python -m forked_child WHAT [ARG]`."""

import json
import os
import signal
import sys
import time

what = sys.argv[1]
if what == "report":  # what the child sees of its process
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "marker": os.environ.get("FORKED_MARKER"),
                      "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                      "sigint_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                      "stdin": sys.stdin.readline().strip(), "jax_loaded": "jax" in sys.modules,
                      "pid": os.getpid()}))
elif what == "exit":
    print("exiting", flush=True)
    raise SystemExit(int(sys.argv[2]))
elif what == "sleep":
    print("sleeping", flush=True)
    time.sleep(60)
elif what == "graceful":  # a learner's stop: SIGTERM asks it to hand in, then it exits 0
    signal.signal(signal.SIGTERM, lambda *_: (print("stopped cleanly", flush=True), os._exit(0)))
    print("sleeping", flush=True)
    time.sleep(60)
elif what == "atexit":
    import atexit
    atexit.register(lambda: print("atexit ran", flush=True))
elif what == "cmdline":
    print(open("/proc/self/cmdline", "rb").read().replace(b"\0", b" ").decode().strip())
elif what == "modules":  # which of the named modules the child has without importing them
    print(json.dumps({name: name in sys.modules for name in sys.argv[2:]}))
