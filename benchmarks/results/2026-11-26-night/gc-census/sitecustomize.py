import gc, os, threading, time
_mode = os.environ.get("GCX", "")
if _mode.startswith("thr"):
    gc.set_threshold(10_000, 50, 100)
if _mode in ("freeze", "thr", "thrq"):
    threading.Timer(6.0, gc.freeze).start()
if _mode in ("freeze", "thr", "log"):
    _t = [0.0]
    _tot = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    _path = f"/tmp/gcx/tot-{_mode}-{os.getpid()}.txt"
    def _cb(phase, info):
        if phase == "start":
            _t[0] = time.perf_counter()
        else:
            g = info["generation"]
            _tot[g][0] += 1
            _tot[g][1] += time.perf_counter() - _t[0]
            if _tot[g][0] % 50 == 1 or g == 2:
                with open(_path, "w") as f:
                    f.write(" ".join(f"g{k}:{n}:{s*1e3:.0f}ms" for k, (n, s) in _tot.items()) + "\n")
    gc.callbacks.append(_cb)
_sw = os.environ.get("SWITCH")
if _sw:
    import sys
    sys.setswitchinterval(float(_sw))
