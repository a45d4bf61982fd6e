"""State kept per running backward (autograd graph task), dropped when that backward did not finish.

Everything the library defers during a backward (gradient contributions in
buckets, all-reduces in flight, ``no_sync`` accumulations) belongs to the
backward that produced it. :class:`PerBackward` keys it by the autograd
engine's graph task (``_torch_compat.current_graph_task_id``) and queues one
end-of-backward callback per task (``queue_callback``, as DDP and FSDP do):
when the callback runs, ``finish(state)`` hands the state on. A backward that
raised (a tensor hook, a NaN check, an out-of-memory error) never runs its
callback; the engine drops the callback with the graph task, and the first
observation after that (the next backward's first contribution, a ``wait()``,
``pending``) calls ``discard(state)``, which waits for what it started (so the
ranks' collectives stay matched) and writes nothing. The callback is held here
by a weak reference only: its death without having run is how an unfinished
backward is told apart from an outer one still running (a reentrant backward,
``torch.utils.checkpoint(use_reentrant=True)``, runs a backward inside another).
"""

from __future__ import annotations

import weakref

from ..core import _torch_compat

__all__ = ["PerBackward", "running_task"]

_engine = _torch_compat.autograd_engine
running_task = _torch_compat.current_graph_task_id  # the running backward's graph task id (-1: none)


class _EndOfBackward:
    """The callback queued on one graph task; alive exactly as long as the engine holds that task."""

    __slots__ = ("owner", "task", "__weakref__")

    def __init__(self, owner, task):
        self.owner, self.task = owner, task

    def __call__(self) -> None:
        self.owner.finish_task(self.task)


class PerBackward:
    """One state per running backward (see the module): ``new()`` makes it on first use in a backward,
    ``finish(state)`` consumes it when that backward ends, ``discard(state)`` when it ended by an exception.

    >>> seen = []
    >>> tracker = PerBackward(list, seen.append, lambda s: None)
    >>> tracker.states()
    []
    """

    def __init__(self, new, finish, discard):
        self._new, self._finish, self._discard = new, finish, discard
        self._tasks: dict = {}  # graph task id -> (weak reference to its queued callback, state)

    def current(self):
        """The running backward's state (made, and its end-of-backward callback queued, on first use);
        the states of backwards that ended without their callback are discarded first."""
        self.purge()
        task = running_task()
        entry = self._tasks.get(task)
        if entry is None:
            callback = _EndOfBackward(self, task)
            _engine.queue_callback(callback)
            entry = self._tasks[task] = (weakref.ref(callback), self._new())
        return entry[1]

    def finish_task(self, task) -> None:
        """The end of backward ``task`` (its queued callback): ``finish`` its state."""
        entry = self._tasks.pop(task, None)
        if entry is not None:
            self._finish(entry[1])

    def purge(self) -> None:
        """``discard`` the state of every backward that ended without running its callback (it raised)."""
        dead = [task for task, (ref, _) in self._tasks.items() if ref() is None]
        for task in dead:
            self._discard(self._tasks.pop(task)[1])

    def states(self) -> list:
        """The states of the backwards still running (after :meth:`purge`), oldest first."""
        self.purge()
        return [state for _, state in self._tasks.values()]
