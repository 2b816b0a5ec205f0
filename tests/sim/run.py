"""Run the raft simulator over many seeds:
``python -m tests.sim.run --seeds N [--seed S] [--voters V] [--membership on|off]``.

``--seeds N`` runs seeds S .. S+N-1 (S defaults to 0); ``--seed S`` alone replays one seed
with a trace of every delivered message. A failing seed prints the command that replays it
and the run exits 1.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

from tests.sim.scenario import LIVENESS_BOUND_MS, SimulationFailure, run_seed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim.run", description=__doc__)
    parser.add_argument("--seeds", type=int, default=None, help="how many seeds to run")
    parser.add_argument("--seed", type=int, default=None, help="first seed (alone: replay it verbosely)")
    parser.add_argument("--voters", type=int, choices=(1, 2, 3, 4, 5), default=None,
                        help="voters per cluster (default: 1, 3 or 5 chosen by the seed)")
    parser.add_argument("--quiet", action="store_true", help="no trace when replaying one seed")
    parser.add_argument("--membership", choices=("on", "off"), default=None,
                        help="change the voter set or not (default: 20%% of the seeds, drawn per seed)")
    args = parser.parse_args(argv)
    if args.seeds is None and args.seed is None:
        parser.error("give --seeds N and/or --seed S")
    first = args.seed if args.seed is not None else 0
    count = args.seeds if args.seeds is not None else 1
    verbose = args.seeds is None and not args.quiet
    started = time.perf_counter()
    events = 0
    totals: collections.Counter[str] = collections.Counter()
    slowest = (0, -1)  # (liveness ms, seed)
    for seed in range(first, first + count):
        try:
            membership = None if args.membership is None else args.membership == "on"
            result = run_seed(seed, args.voters, verbose=verbose, membership=membership)
        except SimulationFailure as exc:
            print(f"FAIL {exc}", file=sys.stderr)
            return 1
        events += result.events
        totals.update(result.stats)
        slowest = max(slowest, (result.liveness_ms, seed))
        if verbose:
            print("\n".join(result.plan))
        if count > 1 and (seed - first + 1) % 1000 == 0:
            print(f"{seed - first + 1} seeds ok ({events} events, {time.perf_counter() - started:.0f} s)", flush=True)
    elapsed = time.perf_counter() - started
    print(f"{count} seeds ok: {events} events in {elapsed:.1f} s ({events / max(elapsed, 1e-9):,.0f} events/s)")
    print(f"slowest liveness: {slowest[0]} simulated ms (seed {slowest[1]}; bound {LIVENESS_BOUND_MS} ms)")
    print("exercised: " + ", ".join(f"{name}={value}" for name, value in sorted(totals.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
