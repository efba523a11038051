"""What a router needs to know a prompt's KV blocks without an engine: the block hash chain, the prompt's token ids,
and the model's tokenizer, which replicas publish to Redis.

Block hashes: the engine's prefix cache (engine/block_manager.py `chain_hash`) names a full block of `block_size`
token ids by blake2b-128 over (the previous block's digest, the ids as little-endian int64). Replicas publish the
first 8 bytes of each digest, hex-encoded, as KV events; `block_hashes` computes the same strings from token ids,
so a router asks Redis which replica holds the longest run of a prompt's leading blocks (tests check the two
chains agree).

Token ids: `prompt_token_ids` builds them as the replica's engine thread does (engine_loop.py `_prompt`): a chat
through the model's chat template, a text prompt through the tokenizer with its special tokens, a continuation's
parts appended. A front without the tokenizer (none published yet) routes by load and affinity alone.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from array import array
from collections.abc import Sequence

from shared.protocol import GenerationRequest

HASH_BYTES = 8  # of the engine's 16-byte digest: 64 bits name a block well enough for a routing hint
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def block_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[str]:
    """The routing names of `token_ids`' full blocks (at most `limit` of them), in order."""
    out: list[str] = []
    parent = b""
    n = len(token_ids) // block_size
    for i in range(n if limit is None else min(n, limit)):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        parent = h.digest()
        out.append(parent[:HASH_BYTES].hex())
    return out


def routing_name(digest: bytes) -> str:
    """A block hash of the engine's prefix cache as replicas publish it."""
    return digest[:HASH_BYTES].hex()


def chat_prompt(request: GenerationRequest, tokenizer, add_generation_prompt: bool = True) -> str:
    """The text a chat request's messages (and tools) make through the model's chat template, ready for the
    assistant's turn (ValueError if the template refuses them)."""
    try:
        return tokenizer.apply_chat_template([m.for_template() for m in request.messages], tools=request.tools,
                                             tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja's TemplateError (raise_exception in the template) and the like
        raise ValueError(f"messages: the model's chat template refused them: {e}") from None


def prompt_token_ids(request: GenerationRequest, tokenizer) -> list[int]:
    """The token ids the replica will run for `request` (ValueError if its chat template refuses the messages)."""
    prompt = request.prompt if request.messages is None else chat_prompt(request, tokenizer)
    ids = list(prompt) if isinstance(prompt, list) else tokenizer(prompt).input_ids
    for part in request.continuation.parts if request.continuation is not None else ():
        ids += part if isinstance(part, list) else tokenizer(part, add_special_tokens=False).input_ids
    return ids


def tokenizer_files(tokenizer) -> dict[str, str]:
    """The tokenizer's files as text (what a replica stores under keys.tokenizer(model))."""
    with tempfile.TemporaryDirectory() as d:
        tokenizer.save_pretrained(d)
        return {name: open(os.path.join(d, name), encoding="utf-8").read()
                for name in TOKENIZER_FILES if os.path.exists(os.path.join(d, name))}


def load_tokenizer(files: dict[str, str]):
    """A tokenizer from the files a replica published (no model files needed; nothing runs but the template)."""
    from transformers import AutoTokenizer  # heavy: only fronts that route import it, once

    with tempfile.TemporaryDirectory() as d:
        for name, text in files.items():
            if name in TOKENIZER_FILES:  # never a path from Redis
                with open(os.path.join(d, name), "w", encoding="utf-8") as f:
                    f.write(text)
        return AutoTokenizer.from_pretrained(d)
