"""Quiet vLLM's one warning that every generation server start logged, with its traceback,
for a choice we make on purpose.

Our engines run with ``skip_tokenizer_init=True`` (the generation server tokenizes, and sends
token ids), so vLLM's chat-template warm-up at engine start fails on the missing tokenizer
and logs ``Chat template warmup failed`` with a ``ValueError`` traceback; an operator looking
for why a worker died greps logs for ``Traceback``. Only that record is dropped: any other
failure of the warm-up, and every other vLLM message, is logged as before.
"""
from __future__ import annotations

import logging

LOGGER = "vllm.renderers.base"
"""The vLLM module that logs it (``vllm.renderers.base.BaseRenderer.warmup``)."""


class SkippedTokenizerWarmup(logging.Filter):
    """Drops the chat-template warm-up's failure on the tokenizer we skip."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != "Chat template warmup failed" or not record.exc_info:
            return True
        error = record.exc_info[1]
        return not (isinstance(error, ValueError) and "skip_tokenizer_init" in str(error))


def quiet_skipped_tokenizer_warmup() -> None:
    """Install the filter once on vLLM's logger (idempotent)."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, SkippedTokenizerWarmup) for f in logger.filters):
        logger.addFilter(SkippedTokenizerWarmup())
