"""A character-level tokenizer that needs no download and round-trips through `AutoTokenizer`.

Every printable ASCII character (plus newline and tab) is one token; unknown characters map to `<unk>`.
It is built with `tokenizers` (WordLevel over single characters) and wrapped in `PreTrainedTokenizerFast`,
so `save_pretrained` / `AutoTokenizer.from_pretrained` give back exactly the same vocabulary.
"""

from __future__ import annotations

import string

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN)

# Printable ASCII without the "\r\x0b\x0c" oddities, plus newline and tab.
CHARACTERS = tuple(sorted(set(string.printable) - set("\r\x0b\x0c")))

# System and user turns are concatenated verbatim; an assistant turn is followed by EOS. The generation prompt is
# empty: a task prompt such as "3+5=" already ends where the answer starts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ message['content'] }}{{ eos_token }}"
    "{%- else -%}"
    "{{ message['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def vocabulary() -> dict[str, int]:
    """Token -> id: the special tokens first (pad=0, eos=1, bos=2, unk=3), then one id per character."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer():
    """Build the character-level tokenizer in memory (deterministic; identical on every call)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token=UNK_TOKEN))
    # Every character is its own pre-token ([\s\S] also matches newlines).
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # join characters without inserting spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
