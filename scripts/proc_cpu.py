#!/usr/bin/env python3
"""CPU seconds (user + system, from /proc) of processes and all their descendants.

Usage: proc_cpu.py PID...   (prints the total), or `from proc_cpu import tree_cpu`.
"""

import os
import sys


def tree_cpu(roots):
    """CPU seconds of `roots` and every process below them."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                rest = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(p)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
    total, todo = 0, list(roots)
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0))[1]
        todo += [c for c, (ppid, _) in stats.items() if ppid == pid]
    return total / tick


if __name__ == "__main__":
    print(tree_cpu(int(a) for a in sys.argv[1:]))
