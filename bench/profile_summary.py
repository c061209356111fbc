"""Summarise py-spy collapsed stacks (`--format raw`): where the sampled time goes.

Usage: python -m bench.profile_summary FILE [--top 25] [--thread MainThread]

Self time is the innermost frame of each sample; inclusive time counts each function once per sample
it appears in. Idle samples (py-spy --idle is off) are not recorded, so percentages are of busy time.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _name(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    if match is None:
        return frame.strip()
    path = match["file"]
    for marker in ("site-packages/", "/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{match['func']} ({path})"


def summarise(path: Path, thread: str | None = None) -> tuple[int, Counter[str], Counter[str]]:
    total = 0
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = stack.split(";")
        if thread is not None and thread not in frames[0]:
            continue
        count = int(count_text)
        names = [_name(f) for f in frames[1:]] or [_name(frames[0])]
        total += count
        own[names[-1]] += count
        for name in set(names):
            inclusive[name] += count
    return total, own, inclusive


def render(path: Path, top: int = 25, thread: str | None = None) -> str:
    total, own, inclusive = summarise(path, thread)
    if total == 0:
        return f"{path}: no samples"
    lines = [f"{path.name}: {total} samples" + (f" (thread {thread})" if thread else ""), "", "self time:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in own.most_common(top)]
    lines += ["", "inclusive time:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in inclusive.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--thread", default=None, help="only stacks whose thread label contains this")
    args = parser.parse_args(argv)
    print(render(args.file, args.top, args.thread))
    return 0


if __name__ == "__main__":
    sys.exit(main())
