"""Run a job's entry point as ``python`` would, and end the process without interpreter shutdown.

    python -m dtrain.launch.entry script.py [args...]
    python -m dtrain.launch.entry -m package.module [args...]

The script sees what ``python script.py args`` gives it: its own ``__main__`` module (``__file__``,
``__loader__``, no runner names), ``sys.argv`` and ``sys.path[0]``; ``-m`` runs a module as
``python -m`` does. Exit codes, ``sys.exit(n)``, uncaught exceptions (the same traceback, without
this module's frames), an uncaught ``KeyboardInterrupt`` (the process dies of SIGINT) and signals
behave as under ``python``. Then non-daemon threads are joined and atexit handlers run, as
``Py_FinalizeEx`` does first; files the script left open are closed, as their deallocation at
shutdown would (a ``gzip`` file gets its trailer); the standard streams and C's stdio buffers are
flushed; and the process ends with ``os._exit``. Like CPython, which does not promise it either,
this runs no other ``__del__`` of objects still alive at exit.

Why: ``Py_FinalizeEx`` goes on to tear the interpreter down while C++ threads still run. With
gloo, a worker thread that drops the last reference to a finished collective (one the script left
pending, or torch's own) needs the GIL to free its tensors; a finalizing interpreter ends that
thread instead, and unwinding it through a ``noexcept`` destructor calls ``std::terminate``: a
rank that finished its work dies of SIGABRT (pytorch/pytorch#190489; a small DDP script with
pending ``all_gather``\\s fails most runs of plain ``torchrun`` here). Nothing of the script's is
lost by skipping that teardown: its threads, atexit handlers and buffered output are done first.

The job's key (:mod:`dtrain.jobkey`) leaves the environment before the script runs, so nothing
the script starts inherits it. In a SageMaker data-parallel job (``SM_FRAMEWORK_PARAMS``), the
``smddp`` backend is registered before the script runs, as AWS's PyTorch has it built in.

Under torchrun, the same guarantee: ``torchrun ... -m dtrain.launch.entry script.py args``; the
script can ``import smdistributed...`` there too, as in a job (the shim goes last on its path).
"""

from __future__ import annotations

import _io
import atexit
import builtins
import contextlib
import ctypes
import gc
import json
import os
import runpy
import signal
import sys
import threading
import traceback
import types
from importlib.machinery import SourceFileLoader
from typing import NoReturn

from dtrain.compat import add_shim_to_path, graft
from dtrain.jobkey import take_key

USAGE = "usage: python -m dtrain.launch.entry (script.py | -m module) [args...]"
FLUSH_FAILED = 120
"""Python's own exit status when flushing the standard streams at exit fails."""


def main(argv: list[str]) -> None:
    """Run ``argv`` (a script or ``-m module``, then its arguments) and end the process."""
    if not argv or argv == ["-m"]:
        print(USAGE, file=sys.stderr)
        os._exit(2)
    take_key()  # the job's key leaves the environment before the script can start anything
    _prepare_job()
    end(run(argv))


def run(argv: list[str]) -> int | KeyboardInterrupt:
    """Run the script or module in a fresh ``__main__``; its exit status, or the interrupt.

    An uncaught exception is reported as ``python`` reports it (``sys.excepthook``)."""
    sys.modules["__main__"] = main_module = types.ModuleType("__main__")
    main_module.__dict__.update(__annotations__={}, __builtins__=builtins)  # as python's has
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0]
            runpy._run_module_as_main(argv[1])  # type: ignore[attr-defined]  # python -m's own
        else:
            _run_script(argv[0], argv[1:], main_module)
    except SystemExit as exit_request:
        return _exit_status(exit_request.code)
    except BaseException as error:  # reported as the interpreter would
        error.__traceback__ = _without_own_frames(error.__traceback__)
        sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__
        sys.excepthook(type(error), error, error.__traceback__)
        if isinstance(error, KeyboardInterrupt):
            return error
        return 1
    return 0


def _run_script(path: str, args: list[str], module: types.ModuleType) -> None:
    """``python path args``: ``sys.path[0]`` is the script's real folder, ``__file__`` absolute."""
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    filename = os.path.join(os.getcwd(), path)
    try:
        with open(path, "rb") as source:  # bytes: compile honours the file's coding cookie
            text = source.read()
    except OSError as error:
        where = f"{sys.orig_argv[0]}: can't open file {filename!r}"
        print(f"{where}: [Errno {error.errno}] {error.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    code = compile(text, filename, "exec", dont_inherit=True)
    module.__dict__.update(
        __file__=filename,
        __cached__=None,
        __loader__=SourceFileLoader("__main__", filename),
        __spec__=None,
        __package__=None,
    )
    exec(code, module.__dict__)


def _exit_status(code: object) -> int:
    """What ``python`` exits with for ``SystemExit(code)``; a message is printed, status 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _without_own_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the script's first frame on, as ``python`` prints it."""
    own = os.path.realpath(__file__)
    while tb is not None and os.path.realpath(tb.tb_frame.f_code.co_filename) == own:
        tb = tb.tb_next
    return tb


def end(status: int | KeyboardInterrupt) -> NoReturn:
    """Finish as ``Py_FinalizeEx`` begins (threads, then atexit), flush, and leave at once."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads
    except BaseException:  # the interpreter reports it, goes on
        print("Exception ignored while joining threads at exit:", file=sys.stderr)
        traceback.print_exc()
    atexit._run_exitfuncs()
    flushed = _flush_standard_streams()
    _close_open_files()
    if not flushed and status == 0:
        status = FLUSH_FAILED
    ctypes.CDLL(None).fflush(None)  # what C and C++ code buffered (stdio, iostreams)
    if isinstance(status, KeyboardInterrupt):  # as python does: die of the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 128 + signal.SIGINT
    os._exit(status & 0xFF)


def _flush_standard_streams() -> bool:
    flushed = True
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # a closed pipe: python exits 120 too
            flushed = False
    return flushed


def _close_open_files() -> None:
    """Close the file objects still open, outermost wrapper first (its close flushes and closes
    what it wraps); the standard streams and what they wrap stay open."""
    keep = _standard_streams()
    objects = gc.get_objects()
    # Every file class, C or Python, derives from the C base: no slow abstract-class check.
    kinds = {kind for kind in set(map(type, objects)) if issubclass(kind, _io._IOBase)}
    files = [obj for obj in objects if type(obj) in kinds and id(obj) not in keep]
    inner = {id(wrapped) for file in files for wrapped in _wrapped(file)}
    for file in sorted(files, key=lambda file: id(file) in inner):
        with contextlib.suppress(Exception):  # as at shutdown: a file that cannot close is left
            file.close()


def _standard_streams() -> set[int]:
    """The ids of the standard streams and of the buffers and files under them."""
    found: set[int] = set()
    layer = [sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__]
    for _ in range(3):  # text, buffer, raw file
        found.update(id(obj) for obj in layer)
        layer = [inner for obj in layer for inner in _wrapped(obj)]
    return found


def _wrapped(obj: object) -> list[object]:
    """What ``obj`` refers to directly: a C wrapper's buffer, a Python wrapper's attributes."""
    found: list[object] = []
    for referent in gc.get_referents(obj):
        found.extend(referent.values() if isinstance(referent, dict) else [referent])
    return found


def _prepare_job() -> None:
    """What a SageMaker container provides before the script runs: the ``smdistributed``
    libraries (a job's ranks have the shim on ``PYTHONPATH``; torchrun's do not), SMP v2's
    ``torch.sagemaker`` (torch installs it on import where dtrain is installed; here also where
    dtrain runs from its source tree, without the entry point torch looks for), and ``smddp`` in
    a data-parallel job (AWS's PyTorch has the backend built in; scripts use it without
    importing anything)."""
    add_shim_to_path()
    graft.install()
    parameters = json.loads(os.environ.get("SM_FRAMEWORK_PARAMS") or "{}")
    if parameters.get("sagemaker_distributed_dataparallel_enabled") is True:
        from dtrain.dataparallel.backend import register_smddp_backend

        register_smddp_backend()


if __name__ == "__main__":
    main(sys.argv[1:])
