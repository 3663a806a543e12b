"""A thread for MLX work that lets the process exit cleanly (the chat's engine, the server's worker).

A process that ran MLX on a thread other than the main one sometimes aborts as it exits
(``terminate called without an active exception``, status 134; mlx 0.32.4 on Linux, 3 to 12 runs in 30 of a
minimal reproduction, also with plain mlx-lm): Python's ``Thread.join`` returns as soon as the thread's Python
function has returned, while the OS thread is still tearing down (its thread-local MLX state, a last garbage
collection); if the main thread meanwhile finalizes the interpreter and runs MLX's static destructors, the two
race and the C++ runtime aborts. Waiting before exiting hides the race; ``MLXThread`` removes it: when its
function returns, the thread releases what it can (a garbage collection, a device synchronize), says it is
finished, and then parks without ever ending, so its thread-local state is never torn down while the process
lives. It is a daemon, so the interpreter does not wait for it.
"""

from __future__ import annotations

import gc
import threading
import traceback
from collections.abc import Callable

import mlx.core as mx


class MLXThread:
    """Runs ``target(*args)`` on a daemon thread that parks, instead of ending, when it returns.

    Args:
        target: The thread's work (it should drop its MLX objects before returning: they are collected
            on this thread).
        args: Its arguments.
        name: The thread's name.
    """

    def __init__(self, target: Callable, args: tuple = (), name: str = "mlxspec-mlx"):
        self._target, self._args = target, args
        self.finished = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the work returned and its MLX state was released; returns whether it did in time."""
        return self.finished.wait(timeout)

    def is_alive(self) -> bool:
        """Whether the work is still running (a parked thread is finished, not alive)."""
        return self._thread.is_alive() and not self.finished.is_set()

    def _main(self) -> None:
        try:
            self._target(*self._args)
        except BaseException:  # noqa: B036 - the thread never ends, so say it here, as threading would
            traceback.print_exc()
        finally:
            self._target = self._args = None
            gc.collect()  # arrays freed now, on this thread, not during its teardown
            try:
                mx.synchronize()
            except RuntimeError:
                pass  # nothing left to wait for
            self.finished.set()
        threading.Event().wait()  # parked: never torn down while the process lives (see the module docstring)
