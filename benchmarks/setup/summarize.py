#!/usr/bin/env python3
"""The figures of measure.sh's logs, one table row per log:

    python3 benchmarks/setup/summarize.py /tmp/floe-setup-logs/*.log
"""
import re
import sys


def figures(path: str) -> dict[str, object]:
    lines = open(path, encoding="utf-8").read().splitlines()
    out: list[tuple[float, str]] = []
    f: dict[str, object] = {"log": path.rsplit("/", 1)[-1].removesuffix(".log")}
    for ln in lines:
        m = re.match(r"^\s*(\d+\.\d) (.*)$", ln)
        if m:
            out.append((float(m.group(1)), m.group(2)))
        elif ln.startswith("label "):
            f["commit"] = ln.split("commit ")[1]
        elif ln.startswith(("start ", "end ")):
            f[ln.split()[0] + "_load"] = ln.split("load average: ")[1]
            if ln.startswith("start "):
                f["date"] = ln.split()[1]
        elif ln.startswith("rc "):
            f["rc"], f["wall_s"] = ln.split()[1], float(ln.split()[3])
        elif ln.startswith("venv after: "):
            f["venv"] = ln.split("venv after: ")[1]

    def first(pred) -> float | None:
        return next((t for t, s in out if pred(s)), None)

    f["installed_s"] = first(lambda s: "demo/run.py" in s and s.startswith("GO="))
    build = first(lambda s: s.startswith("building floe"))
    # the first line after the build's (before the fix, "starting the reference inference
    # server" could be thinned out off a terminal: then the next line bounds it)
    f["built_s"] = next(
        (t for t, s in out if build is not None and t > build and not s.startswith("building floe")), None
    )
    f["first_progress_s"] = first(lambda s: s.startswith("sessions "))
    f["build_s"] = round(f["built_s"] - build, 1) if build is not None and f["built_s"] is not None else None
    gap, after = 0.0, ""
    for (t0, s0), (t1, _) in zip(out, out[1:], strict=False):
        if t1 - t0 > gap:
            gap, after = t1 - t0, s0
    f["longest_silence_s"] = round(gap, 1)
    f["silent_after"] = after[:70]
    return f


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(figures(p))
