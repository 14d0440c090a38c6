"""A rank that writes its lines in pieces while the other writes whole ones in between (tests/test_output.py).

Rank 0 starts each line, waits, then ends it; rank 1 writes a whole line while rank 0's is open; then both
draw a progress bar with "\\r" and print Python's way (text and newline in two writes under `python -u`)."""

import sys
import time

import hvdp.torch as ht

world = ht.init()
for i in range(4):
    if world.rank == 0:
        print(f"rank0 line{i} begins", end="", flush=True)
        time.sleep(0.3)
        print(" and ends", flush=True)
    else:
        time.sleep(0.1)
        print(f"rank1 line{i} whole", flush=True)
        time.sleep(0.2)
    ht.barrier()
for n in range(3):
    sys.stderr.write(f"\rrank{world.rank} bar {n}")
    sys.stderr.flush()
    time.sleep(0.05)
sys.stderr.write("\n")
print(f"rank{world.rank} done", file=sys.stderr)
print(f"rank{world.rank} unended", end="", flush=True)  # written at exit
