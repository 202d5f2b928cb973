"""Rebuild the tiny corpus and tokenizer the torchtitan recipes and tests train on (no hub access needed).

    python recipes/data/torchtitan/build_assets.py

torchtitan's own test assets (`tests/assets/c4_test`, `tests/assets/tokenizer`) are not in its wheel, and
hub downloads are not available everywhere these run, so the repo ships its own: `corpus/train.jsonl`, one
`{"text": ...}` document per line (the docstrings of Python standard-library modules, PSF licensed), and
`tokenizer/`, a byte-level BPE trained on that corpus with the debug model's vocabulary size (2048), in the
Hugging Face `tokenizer.json` + `tokenizer_config.json` form torchtitan's `HuggingFaceTokenizer` loads.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULES = (
    "abc argparse asyncio base64 bisect calendar collections contextlib copy csv dataclasses datetime decimal "
    "difflib email enum fractions functools gzip hashlib heapq hmac html http.client imaplib inspect io "
    "ipaddress itertools json logging mailbox math multiprocessing numbers operator optparse os pathlib pickle "
    "pprint queue random re sched secrets shelve shlex shutil smtplib socket sqlite3 statistics string "
    "struct subprocess tarfile tempfile textwrap threading timeit tokenize traceback typing unittest urllib.parse "
    "uuid warnings weakref zipfile zlib"
).split()
VOCAB_SIZE = 2048


def documents() -> list[str]:
    docs = []
    for name in MODULES:
        module = importlib.import_module(name)
        for obj in [module, *(v for _, v in sorted(vars(module).items()) if inspect.isclass(v) or inspect.isfunction(v))]:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200 and doc not in docs:
                docs.append(doc)
    return docs


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = documents()
    (HERE / "corpus").mkdir(exist_ok=True)
    with open(HERE / "corpus" / "train.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(docs, trainer)
    (HERE / "tokenizer").mkdir(exist_ok=True)
    tokenizer.save(str(HERE / "tokenizer" / "tokenizer.json"))
    with open(HERE / "tokenizer" / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": False,
                   "add_eos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
    print(f"{len(docs)} documents, {sum(map(len, docs))} characters, vocabulary {tokenizer.get_vocab_size()}")


if __name__ == "__main__":
    main()
