"""A small character-level GPT trained with `Trainer(strategy="monarch")`, surviving a worker SIGKILLed mid-epoch.

    python recipes/lightning_gpt.py                        # 3 replicas; replica 1 SIGKILLs itself at step 12
    python recipes/lightning_gpt.py --fault none           # no failure
    python recipes/lightning_gpt.py --devices 4 --fault sigkill:replica=0:step=20
    python recipes/lightning_gpt.py --fsdp 2 --devices 4 --min-replicas 1   # 2 FSDP replicas of 2 procs

No launcher: this process is the controller. The replicas drop the interrupted step, shrink, keep training,
a replacement is spawned and healed from a live peer (weights, optimizer, LR schedule, data cursor and
Lightning's loop progress), and `fit` returns here with the trained weights loaded. The progress bar shows
`elastic/replicas`; at the end the recovery is printed from the events file, followed by a sample from the
model. The corpus ships inside this file (a few of Shakespeare's sonnets, public domain).
"""

from __future__ import annotations

import argparse
import math

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from monarch_plugin.integrations.lightning import MonarchFSDPStrategy, MonarchStrategy

CORPUS = """\
Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.

When, in disgrace with fortune and men's eyes,
I all alone beweep my outcast state,
And trouble deaf heaven with my bootless cries,
And look upon myself and curse my fate,
Wishing me like to one more rich in hope,
Featured like him, like him with friends possess'd,
Desiring this man's art and that man's scope,
With what I most enjoy contented least;
Yet in these thoughts myself almost despising,
Haply I think on thee, and then my state,
Like to the lark at break of day arising
From sullen earth, sings hymns at heaven's gate;
For thy sweet love remember'd such wealth brings
That then I scorn to change my state with kings.

Let me not to the marriage of true minds
Admit impediments. Love is not love
Which alters when it alteration finds,
Or bends with the remover to remove:
O no! it is an ever-fixed mark
That looks on tempests and is never shaken;
It is the star to every wandering bark,
Whose worth's unknown, although his height be taken.
Love's not Time's fool, though rosy lips and cheeks
Within his bending sickle's compass come:
Love alters not with his brief hours and weeks,
But bears it out even to the edge of doom.
If this be error and upon me proved,
I never writ, nor no man ever loved.

My mistress' eyes are nothing like the sun;
Coral is far more red than her lips' red;
If snow be white, why then her breasts are dun;
If hairs be wires, black wires grow on her head.
I have seen roses damask'd, red and white,
But no such roses see I in her cheeks;
And in some perfumes is there more delight
Than in the breath that from my mistress reeks.
I love to hear her speak, yet well I know
That music hath a far more pleasing sound;
I grant I never saw a goddess go;
My mistress, when she walks, treads on the ground:
And yet, by heaven, I think my love as rare
As any she belied with false compare.
"""


class CharWindows(Dataset):
    """Every `block + 1` characters starting at a multiple of `stride`: input and next-character target."""

    def __init__(self, ids: torch.Tensor, block: int, stride: int):
        self.ids, self.block = ids, block
        self.starts = list(range(0, len(ids) - block - 1, stride))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        chunk = self.ids[self.starts[i] : self.starts[i] + self.block + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(pl.LightningModule):
    def __init__(self, vocab: int, block: int = 32, dim: int = 64, layers: int = 2, heads: int = 4,
                 lr: float = 3e-3, max_steps: int = 100):
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, block, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.tok(ids) + self.pos[:, : ids.shape[1]]))

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        total = self.hparams.max_steps

        def cosine(step: int) -> float:
            return 0.5 * (1 + math.cos(math.pi * min(step, total) / total))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @torch.no_grad()
    def sample(self, prompt: torch.Tensor, n: int) -> torch.Tensor:
        ids = prompt
        for _ in range(n):
            logits = self(ids[:, -self.hparams.block :])[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        return ids


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=3, help="procs: replicas x --fsdp")
    p.add_argument("--min-replicas", type=int, default=2)
    p.add_argument("--epochs", type=int, default=14)
    p.add_argument("--batch", type=int, default=8, help="per-replica batch (global = batch x devices)")
    p.add_argument("--fault", default="sigkill:replica=1:step=12", help="fault to inject, or 'none'")
    p.add_argument("--fsdp", type=int, default=0, help="shard each replica over this many procs (monarch_fsdp)")
    p.add_argument("--accelerator", default="cpu", help="Trainer(accelerator=...): cpu, or gpu (a GPU per proc)")
    args = p.parse_args()

    pl.seed_everything(0)
    chars = sorted(set(CORPUS))
    ids = torch.tensor([chars.index(c) for c in CORPUS])
    split = int(0.9 * len(ids))
    block = 32
    train = CharWindows(ids[:split], block, stride=4)
    val = CharWindows(ids[split:], block, stride=block)
    global_batch = args.batch * args.devices
    max_steps = args.epochs * (len(train) // global_batch)
    model = TinyGPT(len(chars), block=block, max_steps=max_steps)

    knobs = dict(min_replicas=args.min_replicas, fault=None if args.fault == "none" else args.fault)
    if args.fsdp:
        strategy = MonarchFSDPStrategy(procs_per_replica=args.fsdp, auto_wrap_policy={Block}, **knobs)
    else:
        strategy = MonarchStrategy(**knobs)
    trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy, max_epochs=args.epochs,
                         log_every_n_steps=5, default_root_dir="runs/lightning_gpt")
    trainer.fit(model, DataLoader(train, batch_size=args.batch, shuffle=True, drop_last=True),
                DataLoader(val, batch_size=16))

    print(f"global_step {trainer.global_step}, val_loss {trainer.callback_metrics['val_loss']:.3f}; "
          f"replica weights {sorted(set(strategy.replica_checksums.values()))} "
          f"(replicas {sorted(strategy.replica_checksums)})")
    prompt = torch.tensor([[chars.index(c) for c in "Shall I compare thee"]])
    print("sample:", "".join(chars[i] for i in model.sample(prompt, 120)[0].tolist()))


if __name__ == "__main__":
    main()
