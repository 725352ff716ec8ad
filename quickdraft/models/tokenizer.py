"""A ``tokenizer.json`` tokenizer without transformers.

Importing transformers costs 1-2 s of start-up, most of what ``quickdraft generate`` spends
before torch. :class:`FastTokenizer` builds the same tokenizer directly on the ``tokenizers``
package (what transformers' ``PreTrainedTokenizerFast`` wraps), reading ``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json`` and ``chat_template.jinja`` the way
transformers 5 does, and answers the part of ``PreTrainedTokenizerFast``'s interface the
runtime uses. Anything else (other arguments, other methods) is answered by the
transformers tokenizer, built on first use, so a caller never gets a wrong answer, only a
slower one. :func:`load_fast_tokenizer` returns None for a directory whose tokenizer needs
transformers' own code (another tokenizer class, legacy files, settings we do not replay);
``tests/test_fast_tokenizer.py`` holds it equal to ``AutoTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

#: The named special tokens, in transformers' order (``all_special_tokens`` follows it).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: What transformers' tokenizer classes resolve to for these directories: the plain fast one.
FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
#: transformers' ``model_max_length`` when the config gives none.
VERY_LARGE_INTEGER = int(1e30)
#: Config keys that change tokens in ways we do not replay (transformers handles those).
_UNHANDLED_KEYS = ("model_specific_special_tokens", "chat_control_tokens", "fix_mistral_regex")
#: Above this vocabulary size transformers may patch the pre-tokenizer (its Mistral fix).
_MISTRAL_CHECK_VOCAB = 100_000


def load_fast_tokenizer(model_dir: Path) -> FastTokenizer | None:
    """The directory's tokenizer built on ``tokenizers`` alone, or None when it needs
    transformers. Unreadable files raise ``ValueError`` (or ``OSError``)."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "tokenizer_config.json")
    if config is None or not (model_dir / "tokenizer.json").is_file() or (model_dir / "added_tokens.json").exists():
        return None
    if config.get("tokenizer_class") not in FAST_CLASSES or any(k in config for k in _UNHANDLED_KEYS):
        return None
    extra = _extra_tokens(config)
    if extra is not None and not isinstance(extra, list):
        return None
    if any(k.endswith("_token") and k not in SPECIAL_TOKENS and isinstance(v, (str, dict)) for k, v in config.items()):
        return None  # model-specific named tokens (image_token...): transformers' bookkeeping
    try:
        backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    except Exception as exc:  # tokenizers raises plain Exceptions for a malformed file
        raise ValueError(str(exc) or type(exc).__name__) from None
    if backend.truncation is not None or backend.padding is not None:
        return None  # transformers turns these on and off per call
    if backend.get_vocab_size(with_added_tokens=True) > _MISTRAL_CHECK_VOCAB:
        return None
    specials = _special_tokens_map(model_dir, config)
    if specials is None:
        return None
    return FastTokenizer(backend, config, specials, _chat_template(model_dir, config), model_dir)


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return data


def _extra_tokens(config: dict):
    """The config's extra special tokens; the older name counts when the new one is empty."""
    return config.get("extra_special_tokens") or config.get("additional_special_tokens")


def _added_token(value: Any, special: bool | None = None) -> str | AddedToken:
    """A config entry (a string, or an AddedToken as a dict) as transformers reads it."""
    if not isinstance(value, dict):
        return value
    fields = {k: v for k, v in value.items() if k != "__type"}
    if special is not None:
        fields["special"] = special
    return AddedToken(**fields)


def _special_tokens_map(model_dir: Path, config: dict) -> dict | None:
    """The named and extra special tokens: the config's, and, as transformers does for a
    config without ``added_tokens_decoder``, ``special_tokens_map.json``'s named ones over
    them. None when that file lists extra tokens (transformers' merge of those is its own)."""
    found = {k: _added_token(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}
    found["extra"] = [_added_token(t) for t in _extra_tokens(config) or []]
    legacy = None if "added_tokens_decoder" in config else _read_json(model_dir / "special_tokens_map.json")
    for key, value in (legacy or {}).items():
        if key in SPECIAL_TOKENS:
            found[key] = _added_token(value, special=True)
        elif value:
            return None
    return found


def _chat_template(model_dir: Path, config: dict) -> str | dict | None:
    """``chat_template.jinja`` (and ``additional_chat_templates/*.jinja``) over the config's
    ``chat_template``; several templates are a dict by name, as in transformers."""
    templates = {}
    if (model_dir / "chat_template.jinja").is_file():
        templates["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if list(templates) == ["default"]:
        return templates["default"]
    if templates:
        return templates
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template


class Encoding(dict):
    """``{"input_ids", "attention_mask"}``, also read as attributes (as transformers'
    ``BatchEncoding`` is)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class FastTokenizer:
    """``PreTrainedTokenizerFast``'s answers for the calls quickdraft makes, from the
    ``tokenizers`` backend alone; other calls go to the transformers tokenizer."""

    is_fast = True

    def __init__(self, backend: Tokenizer, config: dict, specials: dict, chat_template: str | dict | None,
                 model_dir: Path) -> None:
        self._backend = backend
        self._hf = None
        self.name_or_path = str(model_dir)
        self.chat_template = chat_template
        self.model_max_length = config.get("model_max_length") or VERY_LARGE_INTEGER
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._named = {k: specials[k] for k in SPECIAL_TOKENS if k in specials}
        self._extra = specials["extra"]
        self._replay_added_tokens(config)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        if backend.post_processor is None:
            from tokenizers.processors import TemplateProcessing

            # What transformers installs then (no bos/eos: a tokenizer.json's add_bos_token is ignored)
            backend.post_processor = TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])

    def _replay_added_tokens(self, config: dict) -> None:
        """Add tokens to the backend as ``TokenizersBackend.__init__`` does: the config's
        ``added_tokens_decoder`` (else tokenizer.json's own added tokens, again), then the
        special tokens missing from the added vocabulary, named ones marked special."""
        decoder = config.get("added_tokens_decoder")
        if decoder is not None:
            listed = [_added_token(t) for _, t in sorted(decoder.items(), key=lambda item: int(item[0]))]
        else:  # transformers re-adds tokenizer.json's own added tokens
            listed = [t for _, t in sorted(self._backend.get_added_tokens_decoder().items())]
        have = set(self.added_tokens_encoder) | {str(t) for t in listed}
        missing = []
        for token in [*self._named.values(), *self._extra]:
            if str(token) not in have and token not in missing:
                missing.append(token)
        named = {str(t) for t in self._named.values()}
        to_add = []
        for token in [*listed, *missing]:
            if isinstance(token, str):
                token = AddedToken(token, special=True)
            elif not token.special and str(token) in named:
                token.special = True
            to_add.append(token)
        if to_add:
            self._backend.add_tokens(to_add)

    # -- encoding ---------------------------------------------------------------------------

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, verbose: bool = True, **kwargs):
        """``{"input_ids", "attention_mask"}`` of one text (or a list of texts). Any other
        argument (tensors, padding, pairs...) is transformers' to answer."""
        if kwargs or not (isinstance(text, str) or (isinstance(text, list) and all(isinstance(t, str) for t in text))):
            return self.to_transformers()(text, add_special_tokens=add_special_tokens, verbose=verbose, **kwargs)
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return Encoding(input_ids=ids, attention_mask=[1] * len(ids))
        encodings = self._backend.encode_batch(text, add_special_tokens=add_special_tokens)
        return Encoding(input_ids=[e.ids for e in encodings], attention_mask=[e.attention_mask for e in encodings])

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.to_transformers().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
               **kwargs) -> str | list[str]:
        if kwargs:
            return self.to_transformers().decode(token_ids, skip_special_tokens=skip_special_tokens,
                                                 clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)
        if hasattr(token_ids, "tolist"):  # a tensor or an array
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self.decode(ids, skip_special_tokens, clean_up_tokenization_spaces) for ids in token_ids]
        text = self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean and type(self._backend.model).__name__ != "BPE":  # transformers 5 never cleans BPE output
            text = clean_up_tokenization(text)
        return text

    def batch_decode(self, sequences, **kwargs) -> list[str]:
        return [self.decode(ids, **kwargs) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | list[str]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            found = self._backend.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    # -- vocabulary and special tokens ------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._backend

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (``len`` counts them)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self._backend.get_added_tokens_decoder()

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self.added_tokens_decoder.items())}

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_tokens_encoder

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens as strings (transformers 5: not the extra ones)."""
        return {k: str(v) for k, v in self._named.items()}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *(str(t) for t in self._extra)]))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    @property
    def extra_special_tokens(self) -> list[str]:
        return [str(t) for t in self._extra]

    bos_token = property(lambda self: self._token("bos_token"))
    eos_token = property(lambda self: self._token("eos_token"))
    unk_token = property(lambda self: self._token("unk_token"))
    sep_token = property(lambda self: self._token("sep_token"))
    pad_token = property(lambda self: self._token("pad_token"))
    cls_token = property(lambda self: self._token("cls_token"))
    mask_token = property(lambda self: self._token("mask_token"))
    bos_token_id = property(lambda self: self._token_id("bos_token"))
    eos_token_id = property(lambda self: self._token_id("eos_token"))
    unk_token_id = property(lambda self: self._token_id("unk_token"))
    sep_token_id = property(lambda self: self._token_id("sep_token"))
    pad_token_id = property(lambda self: self._token_id("pad_token"))
    cls_token_id = property(lambda self: self._token_id("cls_token"))
    mask_token_id = property(lambda self: self._token_id("mask_token"))

    def _token(self, name: str) -> str | None:
        token = self._named.get(name)
        return None if token is None else str(token)

    def _token_id(self, name: str) -> int | None:
        token = self._named.get(name)
        if token is None:
            return None
        found = self._backend.token_to_id(str(token))
        return found if found is not None or name == "unk_token" else self.unk_token_id

    # -- chat -------------------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template to render: as transformers picks it (a named one, ``tool_use`` when
        tools are given, else ``default``)."""
        if isinstance(self.chat_template, dict):
            if chat_template is not None and chat_template in self.chat_template:
                return self.chat_template[chat_template]
            if chat_template is not None:
                return chat_template
            if tools is not None and "tool_use" in self.chat_template:
                return self.chat_template["tool_use"]
            if "default" in self.chat_template:
                return self.chat_template["default"]
            raise ValueError("this model has several chat templates and none is named default; pick one by name: "
                             f"{', '.join(sorted(self.chat_template))}")
        if chat_template is not None:
            return chat_template
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return self.chat_template

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, **kwargs):
        """One conversation rendered as text (``tokenize=False``) the way transformers renders
        it; tokenized output, batches, callables as tools and transformers' own options are
        transformers' to answer. Other keyword arguments reach the template as variables."""
        own = {"continue_final_message", "sanitize_control_tokens", "padding", "truncation", "max_length",
               "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        plain_tools = tools is None or all(isinstance(t, dict) for t in tools)
        if tokenize or batched or not plain_tools or own & kwargs.keys() or not isinstance(conversation, list):
            return self.to_transformers().apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs)
        from .chat_template import render_chat_template

        template = self.get_chat_template(chat_template, tools)
        variables = {**self.special_tokens_map, **kwargs}
        return render_chat_template(template, conversation, tools=tools, documents=documents,
                                    add_generation_prompt=add_generation_prompt, **variables)

    # -- the rest: transformers ---------------------------------------------------------------

    def to_transformers(self):
        """The same tokenizer as transformers builds it (imported on first use)."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast.from_pretrained(self.name_or_path)
        self._hf.model_max_length = self.model_max_length
        return self._hf

    def save_pretrained(self, save_directory, **kwargs):
        """transformers' save (its file formats), with this tokenizer's ``model_max_length``."""
        return self.to_transformers().save_pretrained(save_directory, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # our own state (also: copy/pickle probing before __init__)
            raise AttributeError(name)
        return getattr(self.to_transformers(), name)

    def __repr__(self) -> str:
        return f"FastTokenizer(name_or_path={self.name_or_path!r}, vocab={len(self)})"


def clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces before punctuation and contractions (WordPiece
    output; transformers 5 skips it for BPE, as :meth:`FastTokenizer.decode` does)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
