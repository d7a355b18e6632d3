"""Imported first by a local launch's fork server (``process.PRELOAD``), before torch: the
server dies with the launcher that started it, even while it is still importing.

Without this a launcher killed in its first seconds left the server importing torch for
seconds more (15 s on a loaded machine) before it read that its launcher had gone: a
process left behind, holding the launcher's standard output and error open (a pipe's
reader, ``paratrain train | tee log``, waited on it). The server's own children die with it
(``process.die_with_parent``).
"""

import ctypes
import os
import signal


def _die_with_launcher() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the launcher's thread that started it
    except (OSError, AttributeError):
        return  # not Linux: the server reads its launcher's end once its imports are done
    if os.getppid() == 1:  # the launcher died before the line above
        os._exit(0)


_die_with_launcher()
