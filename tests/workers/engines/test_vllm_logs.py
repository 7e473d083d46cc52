"""Only vLLM's warm-up failure on the tokenizer we skip on purpose is dropped from the logs."""
from __future__ import annotations

import logging
import sys

from workers.engines.vllm_logs import (LOGGER, SkippedTokenizerWarmup,
                                       quiet_skipped_tokenizer_warmup)


def _record(msg: str, error: BaseException | None) -> logging.LogRecord:
    exc_info = None
    if error is not None:
        try:
            raise error
        except BaseException:
            exc_info = sys.exc_info()
    return logging.LogRecord(LOGGER, logging.WARNING, __file__, 1, msg, (), exc_info)


def test_only_the_skipped_tokenizer_warmup_is_dropped():
    f = SkippedTokenizerWarmup()
    skipped = ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
    assert not f.filter(_record("Chat template warmup failed", skipped))
    assert f.filter(_record("Chat template warmup failed", ValueError("a broken template")))
    assert f.filter(_record("Chat template warmup failed", RuntimeError("skip_tokenizer_init")))
    assert f.filter(_record("Chat template warmup failed", None))
    assert f.filter(_record("something else", skipped))


def test_installed_once():
    quiet_skipped_tokenizer_warmup()
    quiet_skipped_tokenizer_warmup()
    filters = logging.getLogger(LOGGER).filters
    assert sum(isinstance(f, SkippedTokenizerWarmup) for f in filters) == 1
