"""Imported by a rank's forkserver as it starts (hvdp._workers.preload_forkserver puts it in the preload list),
never by a rank: imports the modules and the script that every data-loading worker forked from the
forkserver would otherwise import again, each worker (torch alone takes seconds).

What to import is in the environment variable HVDP_FORKSERVER_PRELOAD (JSON: "modules", and the script as
multiprocessing's spawn names it). A failure is printed and skipped: each worker then imports for itself and
reports the error where the DataLoader shows it.
"""

from __future__ import annotations

import json
import os
import sys


def _preload() -> None:
    try:
        spec = json.loads(os.environ.get("HVDP_FORKSERVER_PRELOAD", "{}"))
    except ValueError:
        return
    if spec.get("ignore_signals"):  # preemption is on: the forkserver and the workers it forks outlive the signal
        from hvdp._workers import ignore_stop_signals
        ignore_stop_signals(tuple(spec["ignore_signals"]))
    for name in spec.get("modules", []):
        try:
            __import__(name)
        except Exception as e:  # noqa: BLE001 - the workers import it again and report it
            print(f"hvdp: the forkserver could not preload {name} ({type(e).__name__}: {e})", file=sys.stderr)
    main = {k: spec[k] for k in ("init_main_from_path", "init_main_from_name") if k in spec}
    if not main:
        return
    from multiprocessing import process, spawn

    process.current_process()._inheriting = True
    try:
        spawn.prepare(main)  # the script as module __mp_main__, as every worker would import it
    except (Exception, SystemExit) as e:  # noqa: BLE001
        print(f"hvdp: the forkserver could not import the script ({type(e).__name__}: {e}); each DataLoader "
              f"worker will import it itself", file=sys.stderr)
    finally:
        del process.current_process()._inheriting


_preload()
