"""Ending a torch.distributed Gloo worker without the abort torch 2.13 sometimes raises at exit."""

import os
import sys


def end_gloo_worker(dist):
    """Destroy the process group, then leave without running static destructors.

    With torch 2.13, about one exit in four of a Gloo worker aborts after main() has returned ("terminate
    called without an active exception", no Python frame left), even after destroy_process_group(). The
    results are printed by then; skipping the C++ teardown keeps the exit status honest.
    """
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
