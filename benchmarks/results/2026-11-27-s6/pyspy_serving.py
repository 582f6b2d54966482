"""The worker process's serving samples in a py-spy ``--subprocesses --format raw``
profile of ``bench --model``: stacks under start-up (imports, engine load, the
compile workers, warm-up) dropped, the rest grouped by thread kind and by
function (inclusive and self shares).

    python3 benchmarks/results/2026-11-27-s6/pyspy_serving.py PROFILE.txt[.gz] 'worker run'
"""

from __future__ import annotations

import collections
import gzip
import sys

START = ("_find_and_load", "Worker.start", "GpuStage.__init__", "TorchEngine.__init__",
         "compile_worker", "load_engine", "check_available", "_warm")  # fmt: skip


def main() -> None:
    path, marker = sys.argv[1], sys.argv[2]
    opener = gzip.open if path.endswith(".gz") else open
    total = 0
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    with opener(path, "rt") as f:
        for line in f:
            stack, count = line.rstrip().rsplit(" ", 1)
            frames = stack.split(";")
            at = next(
                (i for i, fr in enumerate(frames) if fr.startswith("process ") and marker in fr),
                None,
            )
            if at is None:
                continue
            frames = frames[at + 1 :]
            if any(s in fr for fr in frames for s in START):
                continue
            n = int(count)
            total += n
            names = [fr.split(" (")[0] for fr in frames]
            if "Handle._run" in names:
                kind = "event loop"
            elif "_WorkItem.run" in names:
                i = names.index("_WorkItem.run")
                kind = "pool: " + (names[i + 1] if i + 1 < len(names) else "?")
            else:
                kind = names[3] if len(names) > 3 else "/".join(names)
            threads[kind] += n
            for name in set(names):
                inclusive[name] += n
            own[frames[-1] if frames else ""] += n
    print(f"serving samples {total}")
    for title, counter, k in (
        ("threads", threads, 12),
        ("inclusive", inclusive, 50),
        ("self", own, 25),
    ):
        print(f"--- {title}")
        for name, n in counter.most_common(k):
            print(f"{100 * n / total:5.1f}% {name}")


if __name__ == "__main__":
    main()
