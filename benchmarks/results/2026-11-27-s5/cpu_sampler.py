"""CPU of the processes whose command line holds each pattern, once a second.

    python cpu_sampler.py PATTERN... > cpu.txt

Each line: seconds since start, then PATTERN=cores (user + system time over
the second) for the first pattern each process matches. Benchmark code.
"""

import os
import sys
import time

PATTERNS = sys.argv[1:]
HZ = os.sysconf("SC_CLK_TCK")


def snapshot() -> dict[tuple[str, str], float]:
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode()
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        for p in PATTERNS:
            if p in cmd:
                out[(p, pid)] = (int(stat[11]) + int(stat[12])) / HZ
                break
    return out


def main() -> None:
    before, start = snapshot(), time.time()
    while True:
        time.sleep(1.0)
        now = snapshot()
        cores: dict[str, float] = {}
        for key, used in now.items():
            cores[key[0]] = cores.get(key[0], 0.0) + used - before.get(key, used)
        shares = " ".join(f"{p[:18]}={cores.get(p, 0.0):.2f}" for p in PATTERNS)
        print(f"{time.time() - start:6.0f} {shares}", flush=True)
        before = now


if __name__ == "__main__":
    main()
