"""The trainers' stream of batches: the loader over epochs, with the count a resume needs."""

from __future__ import annotations

from .config import ConfigError

__all__ = ["BatchStream"]


class BatchStream:
    """The loader as an endless stream over epochs, counting batches consumed for resume.

    :meth:`peek` fetches the next batch ahead of its step (the loop builds its plan while the
    GPU still runs the step before); it counts as consumed only when ``next`` takes it, so a
    checkpoint in between resumes at that batch.
    """

    def __init__(self, loader, sampler):
        if len(sampler) == 0:
            raise ConfigError("data.tokens_per_batch: the corpus gives no batch to some "
                              "data-parallel rank; use more data or fewer ranks")
        self.loader, self.sampler = loader, sampler
        self.consumed = 0
        self._it = None
        self._ahead = None

    def state_dict(self) -> dict:
        return self.sampler.state_dict(batches_consumed=self.consumed)

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self.consumed = int(state["batches_consumed"])
        self._it = self._ahead = None

    def peek(self):
        """The next batch, not yet consumed (fetched once: the next ``next`` returns it). Past
        an epoch's end the sampler is already in the next epoch with 0 consumed: the state of
        a resume at this batch."""
        if self._ahead is None:
            if self._it is None:
                self._it = iter(self.loader)
            try:
                self._ahead = next(self._it)
            except StopIteration:
                self.sampler.set_epoch(self.sampler.epoch + 1)
                self.consumed = 0
                self._it = iter(self.loader)
                self._ahead = next(self._it)
        return self._ahead

    def __next__(self):
        batch, self._ahead = self.peek(), None
        self.consumed += 1
        return batch
