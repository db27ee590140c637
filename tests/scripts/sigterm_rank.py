"""A rank-like process for tests/test_sigterm.py: ``traceml.init()``, ``--steps`` traced steps,
then it waits for a SIGTERM the way ``--mode`` says:

    idle        sleeps in Python between steps (the handler runs on the main thread)
    in-step     sleeps inside an open step (the step ends first, then the flush)
    stuck       waits in C that ignores signals (pthread_cond_wait through ctypes: as a gloo
                collective whose peer died), so only the watcher thread can act
    user-after  installs its own SIGTERM handler after init(): 1 s of work, then it prints and
                exits 0
    user-before installed its own handler before init(): TraceML leaves SIGTERM alone

It prints ``ready`` once the steps are done (stdout, flushed).
"""

import argparse
import ctypes
import signal
import sys
import time

import traceml


def own_handler(signum, frame):
    time.sleep(1.0)  # a checkpoint on preemption: longer than TraceML's 0.5 s step grace
    print("own handler", flush=True)
    sys.exit(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--mode", required=True)
    args = p.parse_args()
    if args.mode == "user-before":
        signal.signal(signal.SIGTERM, own_handler)
    traceml.init()
    if args.mode == "user-after":
        signal.signal(signal.SIGTERM, own_handler)
    for _ in range(args.steps):
        with traceml.trace_step():
            pass
    if args.mode == "in-step":
        with traceml.trace_step():
            print("ready", flush=True)
            time.sleep(0.3)  # the signal comes in here; the step still ends
        time.sleep(60)
    print("ready", flush=True)
    if args.mode == "stuck":
        libc = ctypes.CDLL(None)
        mutex, cond = ctypes.create_string_buffer(64), ctypes.create_string_buffer(64)
        libc.pthread_mutex_init(mutex, None)
        libc.pthread_cond_init(cond, None)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_cond_wait(cond, mutex)  # never signalled, restarted after every signal
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
