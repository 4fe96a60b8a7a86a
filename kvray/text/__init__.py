"""Text handling for both front ends (the offline `LLM` and the OpenAI server): the
tokenizer and chat template (`prompt`), incremental detokenization (`detokenizer`), and
each request's output state (`output`). No Ray, no engine: token ids in, text out."""

from kvray.text.detokenizer import IncrementalDetokenizer
from kvray.text.output import Logprob, OutputDelta, OutputState
from kvray.text.prompt import (
    Message,
    chat_ids,
    document_start_id,
    encode,
    load_chat_template,
    load_tokenizer,
    text_messages,
)

__all__ = [
    "IncrementalDetokenizer",
    "Logprob",
    "Message",
    "OutputDelta",
    "OutputState",
    "chat_ids",
    "document_start_id",
    "encode",
    "load_chat_template",
    "load_tokenizer",
    "text_messages",
]
