"""A small character-level GPT-2 trained by an unchanged HF `Trainer.train()`, surviving a worker SIGKILLed mid-epoch.

    monarch-run --replicas 3 --min-replicas 2 --fault sigkill:replica=1:step=25 recipes/hf_gpt2.py
    monarch-run --replicas 3 --min-replicas 2 recipes/hf_gpt2.py      # no failure
    python recipes/hf_gpt2.py                                         # no monarch-run: trains as usual

The only elastic line is `callbacks=[MonarchElasticCallback()]`. Under `monarch-run` every replica runs this
script; at step 25 replica 1 SIGKILLs itself (`--fault`, the runtime's opt-in fault injection). The other two drop
that step, shrink, keep training; a replacement is spawned, healed from a live peer (weights, AdamW state, LR
schedule, data cursor, TrainerState) and joins mid-epoch. HF's log lines carry `elastic/replicas`, checkpoints
keep landing in `runs/hf_gpt2/` (written by one replica), every replica prints the same weight checksum, and
`monarch-run` prints the recovery it measured from the events file. The model is built from a `GPT2Config`
(nothing is downloaded); the corpus ships inside this file (the opening of Lewis Carroll's *Alice's Adventures
in Wonderland*, 1865, public domain).
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from monarch_plugin import weights_checksum, worker_context
from monarch_plugin.integrations.hf import MonarchElasticCallback

CORPUS = """\
Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: once
or twice she had peeped into the book her sister was reading, but it had no pictures or conversations in it,
'and what is the use of a book,' thought Alice 'without pictures or conversations?'

So she was considering in her own mind (as well as she could, for the hot day made her feel very sleepy and
stupid), whether the pleasure of making a daisy-chain would be worth the trouble of getting up and picking the
daisies, when suddenly a White Rabbit with pink eyes ran close by her.

There was nothing so very remarkable in that; nor did Alice think it so very much out of the way to hear the
Rabbit say to itself, 'Oh dear! Oh dear! I shall be late!' (when she thought it over afterwards, it occurred to
her that she ought to have wondered at this, but at the time it all seemed quite natural); but when the Rabbit
actually took a watch out of its waistcoat-pocket, and looked at it, and then hurried on, Alice started to her
feet, for it flashed across her mind that she had never before seen a rabbit with either a waistcoat-pocket, or
a watch to take out of it, and burning with curiosity, she ran across the field after it, and fortunately was
just in time to see it pop down a large rabbit-hole under the hedge.

In another moment down went Alice after it, never once considering how in the world she was to get out again.

The rabbit-hole went straight on like a tunnel for some way, and then dipped suddenly down, so suddenly that
Alice had not a moment to think about stopping herself before she found herself falling down a very deep well.
"""


class Characters(Dataset):
    """Every `block`-character window of the corpus (stride `stride`), as token ids the model predicts itself."""

    def __init__(self, text: str, block: int, stride: int):
        self.vocab = sorted(set(text))
        ids = torch.tensor([self.vocab.index(c) for c in text])
        self.windows = [ids[i : i + block] for i in range(0, len(ids) - block, stride)]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.vocab[i] for i in ids.tolist())


def sample(model: GPT2LMHeadModel, data: Characters, prompt: str, length: int) -> str:
    """Greedy continuation of `prompt`, character by character."""
    ids = torch.tensor([[data.vocab.index(c) for c in prompt]])
    model.eval()
    with torch.no_grad():
        for _ in range(length):
            logits = model(input_ids=ids[:, -model.config.n_positions :]).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return data.decode(ids[0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size (x replicas = global batch)")
    p.add_argument("--output-dir", default="runs/hf_gpt2")
    args = p.parse_args()

    data = Characters(CORPUS, block=64, stride=6)
    config = GPT2Config(vocab_size=len(data.vocab), n_positions=64, n_embd=96, n_layer=3, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch, num_train_epochs=args.epochs,
        learning_rate=3e-3, warmup_steps=10, logging_steps=5, save_steps=40, save_total_limit=2,
        report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
    )
    elastic = MonarchElasticCallback()
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[elastic])
    trainer.train()

    ctx = worker_context()
    who = f"replica {ctx.replica_id}" if ctx else "single process"
    print(f"[{who}] train() returned at global_step {trainer.state.global_step}; weights {weights_checksum(model)}",
          flush=True)
    if elastic.is_main_replica:
        print(f"[{who}] sample: {sample(model, data, 'Alice was ', 120)!r}", flush=True)


if __name__ == "__main__":
    main()
