"""What a script sees of how it was started, for the zero-code entry tests.

``--out PATH``: each rank writes ``PATH.<rank>.json`` with ``sys.argv``, ``__file__``,
``__name__``, ``__package__``, ``sys.path[0]``, whether ``__spec__`` is None, whether
``sys.modules["__main__"]`` is this module, whether a class defined here pickles, and whether
annotations are evaluated (no ``__future__`` flag inherited). ``--raise``: an uncaught
ValueError two frames deep. ``--exit N``: ``sys.exit(N)``.
"""

import argparse
import json
import os
import pickle
import sys


class Point:
    def __init__(self, x: int) -> None:
        self.x = x


def annotated(x: int) -> int:
    return x


def inner() -> None:
    raise ValueError("planted failure")


def outer() -> None:
    inner()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    p.add_argument("--raise", dest="fail", action="store_true")
    p.add_argument("--exit", type=int, default=None)
    args, _ = p.parse_known_args()
    if args.out:
        facts = {
            "argv": sys.argv,
            "file": __file__,
            "name": __name__,
            "package": __package__,
            "path0": sys.path[0],
            "spec_is_none": __spec__ is None,
            "main_is_me": sys.modules["__main__"].__dict__ is globals(),
            "pickles": pickle.loads(pickle.dumps(Point(3))).x,
            "annotation": repr(annotated.__annotations__["x"]),
        }
        with open(f"{args.out}.{os.environ['RANK']}.json", "w") as f:
            json.dump(facts, f)
    if args.fail:
        outer()
    if args.exit is not None:
        sys.exit(args.exit)


if __name__ == "__main__":
    main()
