"""A streaming `train_dataset` (a torch `IterableDataset`): the runtime's `StreamWindow`, cut into HF's steps.

Every replica reads the same unsharded stream, and one cursor moves only when a step commits (`StreamWindow`, which
also positions a newcomer and checks that the replicas read one stream). Each step reads the next `global batch x
gradient_accumulation_steps` samples and the callback cuts every global micro-batch over the replicas live for that
step.

Where a pass cannot be cut exactly: HF's loop cannot see where a stream ends, so it cannot end a pass with a
shorter step. A pass therefore trains whole steps only; the last `len(stream) mod (global batch x
gradient_accumulation_steps)` samples of every pass are not trained (a warning says how many), and the next pass
starts, as HF's next epoch does, with the stream's `set_epoch(pass)` where it has one.
"""

from __future__ import annotations

from transformers.utils import logging

from monarch_plugin.data.stream import StreamWindow

__all__ = ["ElasticStream"]

logger = logging.get_logger(__name__)


class ElasticStream(StreamWindow):
    """The stream in HF's steps: `micro_batches` global micro-batches of `micro_batch_size` samples; its passes are
    HF's epochs. Global micro-batch `j` of the step in flight is `samples(positions(micro_batch_size)[j])`."""

    def __init__(self, dataset, micro_batch_size: int, micro_batches: int):
        super().__init__(dataset, micro_batch_size * micro_batches)
        self.micro_batch_size = micro_batch_size
        self.micro_batches = micro_batches

    def next_pass(self, left: list) -> bool:
        """A pass that cannot fill a single step from its start ends training (HF sees an empty epoch and stops),
        and is an error in the first pass; one that ends short of a step starts the next."""
        if self.cursor == 0:
            if self.epoch == 0:
                raise ValueError(
                    f"the streaming train_dataset yielded {len(left)} sample(s), fewer than one optimizer step "
                    f"takes ({self.micro_batch_size} x {self.micro_batches} = per_device_train_batch_size x "
                    "--replicas x gradient_accumulation_steps): give it more samples or lower those"
                )
            return False
        if left:
            logger.warning_once(
                f"each pass over the streaming train_dataset ends with {len(left)} sample(s) that do not fill an "
                f"optimizer step of {self.step_samples}; they are not trained. Make the stream's length a multiple "
                f"of {self.step_samples} to train every sample"
            )
        return True
