"""--chat-template as a file, a name or an inline template: the named templates render their
families' formats, the server and `generate` render the one the flag names, and a value that is
none of the three is refused at start."""

from __future__ import annotations

import pytest

from radixserve.__main__ import main
from radixserve.args import ServerArgs
from radixserve.entrypoints.chat_templates import NAMED_CHAT_TEMPLATES, chat_template_source

CHAT = "/v1/chat/completions"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Again"},
]


def render(name: str, messages: list[dict], **special: str) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    [text], _ = render_jinja_template(
        conversations=[messages],
        chat_template=NAMED_CHAT_TEMPLATES[name],
        add_generation_prompt=True,
        **special,
    )
    return text


@pytest.mark.real_model
def test_chatml_renders_as_smollm2s_own_template(default_tokenizer):
    """(It read the tokenizer from a cache path that no longer exists: it always skipped.)"""
    expected = default_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    assert render("chatml", CONVERSATION) == expected


def test_the_named_formats():
    llama3 = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    assert render("llama-3-instruct", CONVERSATION, **llama3) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAgain<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    sp = {"bos_token": "<s>", "eos_token": "</s>"}
    assert render("llama-2-chat", CONVERSATION, **sp) == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Again [/INST]"
    )
    assert render("mistral", CONVERSATION, **sp) == (
        "<s>[INST] Be brief.\n\nHi [/INST]Hello!</s>[INST] Again [/INST]"
    )
    assert render("mistral", CONVERSATION[1:2], **sp) == "<s>[INST] Hi [/INST]"
    assert render("qwen", CONVERSATION[1:2]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render("qwen", CONVERSATION[:2]).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    # an assistant's tool calls leave its content null: rendered empty, not "None"
    tool_turn = [*CONVERSATION[1:2], {"role": "assistant", "content": None}]
    assert "None" not in render("chatml", tool_turn)


def test_inst_formats_refuse_turns_out_of_order():
    from jinja2.exceptions import TemplateError

    for name in ("llama-2-chat", "mistral"):
        with pytest.raises(TemplateError, match="alternating"):
            render(name, [CONVERSATION[2]], bos_token="<s>", eos_token="</s>")


def test_a_file_a_name_an_inline_template_and_neither(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert chat_template_source(str(path)) == "{{ messages[0]['content'] }}"
    assert chat_template_source("chatml") == NAMED_CHAT_TEMPLATES["chatml"]
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert chat_template_source(inline) == inline
    with pytest.raises(ValueError, match="neither a file, nor a template name .*chatml"):
        chat_template_source("chat-ml")
    with pytest.raises(ValueError, match="neither a file"):
        ServerArgs(model_path="/models/m.gguf", chat_template="missing.jinja")
    ServerArgs(model_path="/models/m.gguf", chat_template="llama-3-instruct")


def test_the_server_renders_the_named_template(fake_tm, make_client):
    fake_tm.server_args = ServerArgs(chat_template="mistral")
    with make_client(fake_tm) as client:
        r = client.post(CHAT, json={"messages": CONVERSATION[1:2]})
        assert r.status_code == 200, r.text
        _, kwargs = fake_tm.template_calls[-1]
        assert kwargs["chat_template"] == NAMED_CHAT_TEMPLATES["mistral"]


def test_generate_renders_a_named_or_inline_template_and_refuses_an_unknown_name(tmp_path, capsys):
    from rs_testing import make_tiny_served_model

    model = make_tiny_served_model(str(tmp_path / "m"))
    common = ["--model-path", model, "--dtype", "float32", "--max-total-tokens", "1024"]
    inline = "{{ raise_exception('inline template ran') }}"
    assert main(["generate", "hi", *common, "--chat-template", inline]) == 2
    assert "inline template ran" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", *common, "--chat-template", "llama3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "neither a file, nor a template name" in err and "Traceback" not in err
