"""``prepare``: tokenize text files into one token file (``python -m fsg.data prepare``).

Tokenizers: ``tiktoken:NAME`` (e.g. ``tiktoken:gpt2``; each document is preceded by the
end-of-text token, as llm.c's and nanoGPT's preparation scripts do) when tiktoken is
installed, else ``bytes`` (the UTF-8 bytes, vocabulary 256).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np

from fsg._src.data._formats import write_tokens
from fsg._src.errors import DataError


class Tokenizer(NamedTuple):
    """A name, a vocabulary size, and ``encode(text) -> list[int]`` for one document."""

    name: str
    vocab_size: int
    encode: Callable[[str], list[int]]


def default_tokenizer() -> str:
    """``"tiktoken:gpt2"`` when tiktoken is installed, else ``"bytes"``."""
    return "tiktoken:gpt2" if importlib.util.find_spec("tiktoken") is not None else "bytes"


def tokenizer(name: str) -> Tokenizer:
    """The tokenizer called ``name``: ``"bytes"`` or ``"tiktoken:ENCODING"``.

    Raises:
      DataError: an unknown name, or tiktoken is not installed.
    """
    if name == "bytes":
        return Tokenizer("bytes", 256, lambda text: list(text.encode("utf-8")))
    kind, _, encoding = name.partition(":")
    if kind != "tiktoken" or not encoding:
        raise DataError(
            f"prepare: tokenizer {name!r} is not one of 'bytes' or 'tiktoken:ENCODING' (e.g. tiktoken:gpt2)"
        )
    if importlib.util.find_spec("tiktoken") is None:
        raise DataError(f"prepare: tokenizer {name!r} needs tiktoken (pip install tiktoken); or use --tokenizer bytes")
    import tiktoken

    enc = tiktoken.get_encoding(encoding)
    return Tokenizer(name, enc.n_vocab, lambda text: [enc.eot_token, *enc.encode_ordinary(text)])


def prepare(inputs: Sequence[str | Path], output: str | Path, *, tokenizer_name: str | None = None,
            format: str = "llmc") -> tuple[Path, int, Tokenizer]:  # fmt: skip
    """Tokenizes the text files ``inputs`` (in order) into the token file ``output``.

    Args:
      inputs: UTF-8 text files (undecodable bytes are replaced).
      output: the token file to write.
      tokenizer_name: ``"bytes"`` or ``"tiktoken:ENCODING"``; default ``default_tokenizer()``.
      format: ``"llmc"`` (default) or ``"nanogpt"``.

    Returns:
      ``(output path, token count, tokenizer)``.

    Example:
      >>> fsg.data.prepare(["input.txt"], "train.bin", tokenizer_name="bytes")  # doctest: +SKIP
    """
    tok = tokenizer(tokenizer_name or default_tokenizer())
    if format == "nanogpt" and tok.vocab_size > 65536:
        raise DataError(
            f"prepare: {tok.name} has {tok.vocab_size} ids, more than nanoGPT's uint16 format holds; use llmc"
        )
    pieces = []
    for path in map(Path, inputs):
        if not path.is_file():
            raise DataError(f"prepare: input {path} does not exist (or is not a file)")
        pieces.append(np.asarray(tok.encode(path.read_text(encoding="utf-8", errors="replace")), dtype=np.int64))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    if tokens.size == 0:
        raise DataError(f"prepare: the inputs {[str(p) for p in inputs]} hold no text; nothing to write to {output}")
    return write_tokens(output, tokens, format=format), int(tokens.size), tok


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fsg.data prepare IN.txt [IN2.txt ...] OUT.bin [--tokenizer ...] [--format ...]``."""
    parser = argparse.ArgumentParser(prog="python -m fsg.data", description="fsg.data commands")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenize text files into an llm.c / nanoGPT token file")
    p.add_argument("paths", nargs="+", metavar="PATH", help="input text files, then the output token file")
    p.add_argument(
        "--tokenizer", default=None, help=f"'bytes' or 'tiktoken:gpt2' (default here: {default_tokenizer()})"
    )
    p.add_argument("--format", default="llmc", choices=["llmc", "nanogpt"])
    args = parser.parse_args(argv)
    if len(args.paths) < 2:
        parser.error("prepare takes at least one input file and the output file")
    try:
        out, count, tok = prepare(args.paths[:-1], args.paths[-1], tokenizer_name=args.tokenizer, format=args.format)
    except DataError as error:
        parser.exit(2, f"error: {error}\n")
    print(f"wrote {count:,} tokens ({tok.name}, vocabulary {tok.vocab_size}) to {out} ({args.format} format)")
    return 0
