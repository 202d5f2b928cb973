"""The HF Trainer script the tests run: `monarch-run ... hf_train.py --out DIR`, `torchrun ... hf_train.py`, or
plain `python hf_train.py`; the same code everywhere, with `MonarchElasticCallback` added (unless --no-callback).

A tiny GPT-2 built from `GPT2Config` (no hub download) learns fixed-length random token sequences. With
`--count`, the model also carries a per-epoch sample counter `seen` that only the real gradient path can move:
the loss adds, for this replica's share of the step, `seen[epoch, idx]` normalised like the LM loss (by the
window's label count, which HF passes as `num_items_in_batch`); the callback weights each share by its fraction
of the global batch; and SGD with the counter's learning rate equal to the samples of a whole step then
subtracts exactly 1 for every time a sample took part in a committed step. `-seen` in the final weights is the
per-epoch count of committed sightings of each sample. Momentum and a step-wise LR schedule on the LM make the
heal of optimizer and scheduler state matter; `--count` runs without gradient clipping (it would scale the
counter).

`--stream datasets|torch` trains on the same samples as a stream instead: a `datasets.IterableDataset` (which has
`state_dict`) or a plain torch `IterableDataset` (which has not), `--epochs` passes over it, so `--max-steps` must
cover them; the counter's epoch is then the pass, counted by `on_epoch_begin` (HF's `state.epoch` is a fraction
of `max_steps` for a stream). `--add-late` adds the callback with `trainer.add_callback` after `Trainer(...)`.

Each process writes DIR/result-<id>.json (global step, weight checksum, counts, log history, checkpoints it
saved, whether it was the main replica) and DIR/weights-<id>.pt, where <id> is the replica id under monarch-run,
`rank<RANK>` under torchrun and `single` otherwise; and DIR/progress-<id> (its global step) after every step, so
a test knows when to kill it. `--pause-at N` makes the initial replicas hold step N until the test creates
DIR/release, and a replacement start `train()` only once they are there, so it joins right after step N whatever
the machine's speed. `--bad` builds one of the inputs the callback must reject. `--training-args '{"bf16": true}'`
sets more `TrainingArguments` fields and `--eval N` adds an `eval_dataset` of N samples
(`benchmarks/frontends/hf_features.py` trains each Trainer feature this way).
"""

from __future__ import annotations

import argparse
import json
import os
import time

# One thread per process, as torchrun sets it: several replicas share this machine's two cores. The variable keeps
# accelerate from choosing a count of its own; torch is already initialised in a monarch-run replica, so it is
# also told directly.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset, IterableDataset  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from monarch_plugin import weights_checksum, worker_context  # noqa: E402
from monarch_plugin.integrations.hf import MonarchElasticCallback  # noqa: E402


class Tokens(Dataset):
    """Random token sequences, the same for a given index in every process."""

    def __init__(self, n: int, seq: int, vocab: int):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        x = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(1000 + i))
        return {"input_ids": x, "labels": x.clone(), "idx": i}


class TokenStream(IterableDataset):
    """`Tokens` as a plain stream: no state_dict, no set_epoch."""

    def __init__(self, tokens: Tokens):
        self.tokens = tokens

    def __iter__(self):
        return (self.tokens[i] for i in range(len(self.tokens)))


def streaming(kind: str, tokens: Tokens):
    """The samples of `tokens`, in order, as a `--stream` of that kind."""
    if kind == "torch":
        return TokenStream(tokens)
    import datasets

    rows = [tokens[i] for i in range(len(tokens))]
    columns = {key: [r[key].tolist() if torch.is_tensor(r[key]) else r[key] for r in rows] for key in rows[0]}
    return datasets.Dataset.from_dict(columns).to_iterable_dataset(num_shards=4)


class CountingLM(nn.Module):
    """GPT-2 plus the `seen` counter (see the module docstring); the epoch is set by `Progress`."""

    accepts_loss_kwargs = True

    def __init__(self, lm: GPT2LMHeadModel, epochs: int, samples: int, sample_sleep: float = 0.0):
        super().__init__()
        self.lm = lm
        self.seen = nn.Parameter(torch.zeros(epochs, samples))
        self.epoch = 0
        self.sample_sleep = sample_sleep

    def forward(self, input_ids, labels, idx, num_items_in_batch=None, **kwargs):
        if self.sample_sleep:  # compute that grows with this replica's share, as a bigger model's does
            time.sleep(self.sample_sleep * len(idx))
        out = self.lm(input_ids=input_ids, labels=labels, num_items_in_batch=num_items_in_batch)
        window_samples = num_items_in_batch / labels.shape[1]  # HF counted every label of the window's samples
        return {"loss": out.loss + self.seen[self.epoch, idx].sum() / window_samples}


class Progress(TrainerCallback):
    """Writes the global step after every step and the checkpoints this process saved; optionally slows steps, and
    holds step `pause_at` until the test creates DIR/release."""

    def __init__(self, out: str, ident: str, model: nn.Module, step_sleep: float, pause_at: int, stream: bool):
        self.out, self.ident, self.model, self.step_sleep, self.pause_at = out, ident, model, step_sleep, pause_at
        self.stream, self.epochs_begun = stream, 0
        self.saved: list[int] = []

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.epochs_begun += 1

    def on_step_begin(self, args, state, control, **kwargs):
        if isinstance(self.model, CountingLM):
            self.model.epoch = self.epochs_begun - 1 if self.stream else int(state.epoch or 0)
        if self.step_sleep:
            time.sleep(self.step_sleep)
        while state.global_step == self.pause_at and not os.path.exists(os.path.join(self.out, "release")):
            time.sleep(0.05)

    def on_step_end(self, args, state, control, **kwargs):
        with open(os.path.join(self.out, f"progress-{self.ident}"), "w") as f:
            f.write(str(state.global_step))

    def on_save(self, args, state, control, **kwargs):
        self.saved.append(state.global_step)


def _furthest_step(out: str) -> int:
    steps = [-1]
    for name in os.listdir(out):
        if name.startswith("progress-"):
            with open(os.path.join(out, name)) as f:
                steps.append(int(f.read() or -1))
    return max(steps)


def decay(step: int) -> float:
    return 0.9 ** (step // 3)


def constant(step: int) -> float:
    return 1.0


def main() -> None:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--replicas", type=int, default=1, help="monarch-run --replicas (sizes the counter's lr)")
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size")
    p.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--optimizer", choices=("sgd", "hf"), default="sgd", help="sgd: Trainer(optimizers=...); hf: AdamW")
    p.add_argument("--count", action="store_true", help="add the per-epoch sample counter (needs sgd)")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--save-steps", type=int, default=0, help="0: no checkpoints")
    p.add_argument("--logging-steps", type=int, default=1)
    p.add_argument("--resume", default=None, help="resume_from_checkpoint; 'true': True, the newest in output_dir")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--sample-sleep", type=float, default=0.0,
                   help="with --count: seconds per sample of this replica's share, so a shrunk group steps slower")
    p.add_argument("--pause-at", type=int, default=-1, help="hold this global step until DIR/release exists")
    p.add_argument("--no-callback", action="store_true")
    p.add_argument("--stream", choices=("datasets", "torch"), default=None, help="train on a streaming dataset")
    p.add_argument("--workers", type=int, default=0, help="dataloader_num_workers")
    p.add_argument("--add-late", action="store_true", help="trainer.add_callback(...) after Trainer(...)")
    p.add_argument("--bad", choices=("deepspeed",), default=None)
    p.add_argument("--eval", type=int, default=0, help="an eval_dataset of this many samples (0: none)")
    p.add_argument("--training-args", default="{}", help="more TrainingArguments fields, as a JSON object")
    args = p.parse_args()

    ctx = worker_context()
    ident = str(ctx.replica_id) if ctx else (f"rank{os.environ['RANK']}" if "RANK" in os.environ else "single")
    config = GPT2Config(vocab_size=64, n_positions=args.seq, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model: nn.Module = GPT2LMHeadModel(config)
    if args.count:
        model = CountingLM(model, args.epochs, args.samples, args.sample_sleep)
    training = TrainingArguments(**{
        "output_dir": os.path.join(args.out, "hf"), "per_device_train_batch_size": args.batch,
        "gradient_accumulation_steps": args.accumulate, "num_train_epochs": args.epochs, "max_steps": args.max_steps,
        "max_grad_norm": args.max_grad_norm, "learning_rate": 1e-3, "logging_steps": args.logging_steps,
        "save_strategy": "steps" if args.save_steps else "no", "save_steps": args.save_steps or 500,
        "report_to": "none", "disable_tqdm": True, "use_cpu": True, "seed": 0, "dataloader_num_workers": args.workers,
        **json.loads(args.training_args),
    })
    if args.bad == "deepspeed":
        # DeepSpeed is not installed here, so TrainingArguments cannot validate a DeepSpeed config itself; the
        # field is what the callback checks.
        training.deepspeed = {"zero_optimization": {"stage": 2}}
    optimizers = (None, None)
    if args.optimizer == "sgd":
        lm = model.lm if args.count else model
        groups = [{"params": lm.parameters(), "lr": 0.05, "momentum": 0.9}]
        if args.count:
            groups.append({"params": [model.seen], "lr": float(args.batch * args.replicas * args.accumulate),
                           "momentum": 0.0})
        optimizer = torch.optim.SGD(groups)
        lambdas = [decay, constant][: len(groups)]
        optimizers = (optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas))
    elastic = MonarchElasticCallback()
    progress = Progress(args.out, ident, model, args.step_sleep, args.pause_at, args.stream is not None)
    callbacks = [progress] if args.no_callback or args.add_late else [elastic, progress]
    dataset = Tokens(args.samples, args.seq, config.vocab_size)
    if args.stream:
        dataset = streaming(args.stream, dataset)
    evaluation = Tokens(args.eval, args.seq, config.vocab_size) if args.eval else None
    trainer = Trainer(model=model, args=training, train_dataset=dataset, eval_dataset=evaluation,
                      optimizers=optimizers, callbacks=callbacks)
    if args.add_late:
        trainer.add_callback(elastic)
    if ctx is not None and not ctx.initial and args.pause_at >= 0:
        while _furthest_step(args.out) < args.pause_at:  # a replacement joins while the survivors hold that step
            time.sleep(0.05)
    output = trainer.train(resume_from_checkpoint=True if args.resume == "true" else args.resume)

    result = {
        "replica": ident,
        "initial": bool(ctx.initial) if ctx else True,
        "pid": os.getpid(),
        "global_step": trainer.state.global_step,
        "train_output_step": output.global_step,
        "checksum": weights_checksum(model),
        "main": elastic.is_main_replica,
        "world_process_zero": trainer.state.is_world_process_zero,
        "saved": progress.saved,
        "log_history": trainer.state.log_history,
    }
    if args.count:
        result["counts"] = (-model.seen.detach()).tolist()
    torch.save(model.state_dict(), os.path.join(args.out, f"weights-{ident}.pt"))
    with open(os.path.join(args.out, f"result-{ident}.json"), "w") as f:
        json.dump(result, f)
    print(f"[{ident}] train() returned at global_step {trainer.state.global_step}, weights {result['checksum']}",
          flush=True)


if __name__ == "__main__":
    main()
