"""The engine prompts of a request: a chat rendered by the model's template (its image parts
resolved), or each of a completion's prompts (text gets BOS; token ids go as they are)."""
from __future__ import annotations

from common.errors import ChatTemplateError
from common.tokenizer import Tokenizer
from worker.multimodal.parts import PartResolver
from worker.errors import InvalidRequestError
from worker.multimodal.prompt import MultiModalPrompt, build_prompt
from worker.server.protocol import GenerateRequest, check_text_fits


async def request_prompts(req: GenerateRequest, tokenizer: Tokenizer, images: PartResolver,
                          max_model_len: int) -> list[MultiModalPrompt]:
    if req.kind == "chat":
        try:
            rendered = tokenizer.apply_chat_template(req.messages)
        except ChatTemplateError as exc:
            raise InvalidRequestError(str(exc)) from exc
        check_text_fits(req, len(rendered), tokenizer.min_tokens(rendered), max_model_len)
        return [build_prompt(tokenizer, rendered, await images.resolve(req.media, req.is_decode_leg))]
    prompts = []
    for prompt in req.prompts:
        if isinstance(prompt, str):
            check_text_fits(req, len(prompt), tokenizer.min_tokens(prompt), max_model_len)
            prompts.append(MultiModalPrompt(tokenizer.encode(prompt, add_bos=True), []))
        else:
            prompts.append(MultiModalPrompt(prompt, []))   # the engine checks the ids against its vocabulary
    return prompts
