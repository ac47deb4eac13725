"""Offline assets for torchtitan's debug configs: a byte-level BPE tokenizer and a JSON-lines text data set,
both made from this Python's standard library sources (torchtitan's own debug assets live in its source
repository, not in its wheel, and the GPU machines have no network).

    python benchmarks/torchtitan_assets.py OUT_DIR [--vocab 2000]

writes ``OUT_DIR/tokenizer/{tokenizer.json,tokenizer_config.json}`` (vocabulary <= ``--vocab``, which must
not exceed the model's: 2048 for the DeepSeek-V3 debug model) and ``OUT_DIR/data/train.jsonl``
(``{"text": ...}`` per source file). Pass them to torchtitan 0.2.2 as ``--model.hf_assets_path
OUT_DIR/tokenizer --training.dataset_path OUT_DIR/data`` with the ``c4_test`` data set (loaded with ``datasets``'s
``load_dataset(path, split="train")``). Needs the ``tokenizers`` package (a torchtitan dependency).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sysconfig

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def sources(limit_bytes: int = 8_000_000) -> list[str]:
    """Texts of the standard library's .py files, in a fixed order, up to about ``limit_bytes``."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts:
            continue
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(t)
        total += len(t)
        if total >= limit_bytes:
            break
    if not texts:
        raise RuntimeError(f"no Python sources found under {root}")
    return texts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--vocab", type=int, default=2000)
    a = ap.parse_args(argv)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = sources()
    tok_dir, data_dir = a.out / "tokenizer", a.out / "data"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "train.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts if a.vocab > 4096 else texts[:300], trainer)  # a large vocabulary needs the text
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}))
    print(f"tokenizer: {tok.get_vocab_size()} tokens -> {tok_dir}; data: {len(texts)} texts -> {data_dir}")


if __name__ == "__main__":
    main()
