"""Instructions per Produce request of bench/listener.py's server or
bench/logproc.py's log process, counted by valgrind's cachegrind.

CPU time on a shared machine is too noisy to compare two commits whose
difference is a few per cent: single runs of bench/listener.py at one
commit spread from 15 to 30 µs a request on the 2-core machine of
bench/README.md. An instruction count is the same from run to run (two
runs of one commit agreed within 0.1%). It is not time: a cache miss or a
system call costs more than an instruction, so confirm a large change with
the CPU-time benches too.

    python -m bench.instructions listener
    python -m bench.instructions logproc [--partitions 10000 --calls 5]

Runs `python -m bench.<name> --requests N --runs 1` under cachegrind at
two request counts and prints the busiest process's extra instructions
divided by the extra requests it handled: start-up, imports and warm-up
cancel out. Options it does not know go to the bench (bench/logproc.py's
--partitions and --calls). Takes about a minute a bench. Needs valgrind (Debian:
`apt-get install valgrind`).
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile

# Requests the measured process handles per request asked for: bench/listener.py's server
# also answers as many to warm up; bench/logproc.py warms up with a fixed number.
HANDLED = {"listener": 2, "logproc": 1}


def instructions(bench: str, requests: int, options: list[str]) -> int:
    """The instructions of the busiest process of one run of the bench (with these options)."""
    with tempfile.TemporaryDirectory(prefix="kafscale-cachegrind-") as out:
        subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--trace-children=yes",
                        f"--cachegrind-out-file={out}/cg.%p", sys.executable, "-m", f"bench.{bench}",
                        "--requests", str(requests), "--runs", "1", *options],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=os.getcwd())
        counts = []
        for path in glob.glob(f"{out}/cg.*"):
            with open(path) as f:
                counts += [int(line.split()[1]) for line in f if line.startswith("summary:")]
        return max(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", choices=sorted(HANDLED))
    ap.add_argument("--requests", type=int, nargs=2, default=[5000, 15000], metavar=("FEWER", "MORE"))
    args, options = ap.parse_known_args()
    fewer, more = args.requests
    extra = instructions(args.bench, more, options) - instructions(args.bench, fewer, options)
    print(f"{args.bench}: {extra / (HANDLED[args.bench] * (more - fewer)):,.0f} instructions per Produce request")


if __name__ == "__main__":
    main()
