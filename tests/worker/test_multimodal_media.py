"""Image parts, sans server: parsing, loading under a policy, decoding files, placing placeholders."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from tests.worker.multimodal_helpers import data_url, embeds, pt_bytes, rows, safetensors_bytes, write
from worker.errors import InvalidRequestError
from worker.model.loader import builtin_model_path, load_config
from common.tokenizer import Tokenizer
from worker.multimodal import MediaPolicy, image_embeds, load_part
from worker.multimodal.prompt import IMAGE_MARKER, PLACEHOLDER_TOKEN_ID, build_prompt
from worker.server.cli import parse_args
from worker.server.protocol import MediaPart, parse_request

PART = "messages[0].content[1]"


def load(url: str, policy: MediaPolicy) -> tuple[torch.Tensor, dict]:
    return asyncio.run(load_part(url, policy, PART))


def test_no_local_file_is_read_without_an_allowed_directory(tmp_path: Path) -> None:
    path = write(tmp_path / "a.safetensors", safetensors_bytes(rows(2, 8, 0)))
    for url in (str(path), f"file://{path}", "a.safetensors"):
        with pytest.raises(InvalidRequestError, match="local files are not allowed") as info:
            load(url, MediaPolicy())
        assert info.value.param == PART   # type: ignore[attr-defined]
    tensor, aux = load(data_url(path.read_bytes()), MediaPolicy())   # inline data needs no directory
    assert torch.equal(tensor, rows(2, 8, 0)) and aux == {}


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    import os

    os.mkfifo(tmp_path / "fifo")   # opening it for reading would wait for a writer
    (tmp_path / "dir").mkdir()
    for name in ("fifo", "dir"):
        with pytest.raises(InvalidRequestError, match=f"{name} is not a regular file"):
            load(name, MediaPolicy(tmp_path))


def test_safetensors_keeps_its_metadata_and_other_tensors_as_aux(tmp_path: Path) -> None:
    from safetensors.torch import save

    data = save({"embeddings": rows(3, 8, 1), "grid": torch.tensor([1, 3])}, metadata={"source": "vit"})
    tensor, aux = load("e.safetensors", MediaPolicy(write(tmp_path / "e.safetensors", data).parent))
    assert torch.equal(tensor, rows(3, 8, 1)) and aux == {"source": "vit", "grid": [1, 3]}
    tensor, aux = load(data_url(save({"x": rows(2, 8, 2)}, metadata={"k": "v"})), MediaPolicy())
    assert torch.equal(tensor, rows(2, 8, 2)) and aux == {"k": "v"}   # a lone tensor under any name


def test_pt_files_give_a_tensor_or_a_dict_with_json_able_aux() -> None:
    tensor, aux = load(data_url(pt_bytes(rows(2, 8, 3))), MediaPolicy())
    assert torch.equal(tensor, rows(2, 8, 3)) and aux == {}
    tensor, aux = load(data_url(pt_bytes({"embeddings": rows(2, 8, 3), "size": (4, 4), "t": torch.ones(2)})),
                       MediaPolicy())
    assert aux == {"size": (4, 4), "t": [1.0, 1.0]} and json.dumps(aux)
    with pytest.raises(InvalidRequestError, match="must hold a tensor, or a dict with the tensor under 'embeddings'"):
        load(data_url(pt_bytes({"rows": rows(2, 8, 3)})), MediaPolicy())
    with pytest.raises(InvalidRequestError, match="not a safetensors or torch tensor file"):
        load(data_url(b"just some bytes"), MediaPolicy())


def test_image_embeds_digest_depends_on_bytes_dtype_and_shape() -> None:
    a = embeds(4, 8, 0)
    assert a.digest == embeds(4, 8, 0).digest and a.num_positions == 4
    assert a.digest != embeds(4, 8, 1).digest
    assert a.digest != image_embeds(a.tensor.reshape(2, 16), {}, 16, torch.float32, PART).digest
    with pytest.raises(InvalidRequestError, match=r"shape \[n >= 1, 8\].*got \[0, 8\]"):
        image_embeds(torch.zeros(0, 8), {}, 8, torch.float32, PART)
    with pytest.raises(InvalidRequestError, match="must be a tensor, got list"):
        image_embeds([[1.0]], {}, 1, torch.float32, PART)


def test_build_prompt_puts_n_placeholders_where_each_marker_was() -> None:
    path = builtin_model_path()
    tokenizer = Tokenizer.from_dir(path, load_config(path))
    images = [embeds(3, 8, 0), embeds(2, 8, 1)]
    text = f"ab{IMAGE_MARKER}c{IMAGE_MARKER}"
    prompt = build_prompt(tokenizer, text, images)
    a, b, c = (tokenizer.encode(t, add_bos=False) for t in "abc")
    assert prompt.token_ids == a + b + [PLACEHOLDER_TOKEN_ID] * 3 + c + [PLACEHOLDER_TOKEN_ID] * 2
    assert prompt.spans == [(2, images[0]), (6, images[1])]
    with pytest.raises(InvalidRequestError, match="rendered 2 image placeholders for 1 images"):
        build_prompt(tokenizer, text, images[:1])


def test_chat_parser_keeps_image_parts_in_order() -> None:
    body = {"messages": [{"role": "system", "content": "s"},
                         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}},
                                                      {"type": "text", "text": "x"},
                                                      {"type": "image_url", "image_url": {"url": "b"}}]}]}
    req = parse_request("chat", body, "m")
    assert req.messages[1] == {"role": "user", "content": f"{IMAGE_MARKER}x{IMAGE_MARKER}"}
    assert req.media == [MediaPart("messages[1].content[0]", "image_url", {"url": "a"}),
                         MediaPart("messages[1].content[2]", "image_url", {"url": "b"})]
    for part in ({"type": "audio", "audio": {}}, {"type": "image_url", "image_url": "a"}, "text"):
        with pytest.raises(InvalidRequestError, match="a content part must be") as info:
            parse_request("chat", {"messages": [{"role": "user", "content": [part]}]}, "m")
        assert info.value.param == "messages[0].content[0]"   # type: ignore[attr-defined]


def test_cli_media_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args, _ = parse_args(["--allowed-local-media-path", str(tmp_path), "--max-file-size-mb", "0.5"])
    assert args.allowed_local_media_path == tmp_path and args.max_file_size_mb == 0.5
    assert parse_args([])[0].allowed_local_media_path is None and parse_args([])[0].max_file_size_mb == 50
    for argv, message in ((["--max-file-size-mb", "0"], "--max-file-size-mb must be positive"),
                          (["--allowed-local-media-path", str(tmp_path / "none")], "is not a directory")):
        with pytest.raises(SystemExit) as info:
            parse_args(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err
