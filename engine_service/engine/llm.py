"""vLLM-shaped offline API: LLM(model).generate(prompts, params) and .chat(messages, params)."""
import itertools

from engine_service.engine.config import EngineConfig
from engine_service.engine.llm_engine import LLMEngine
from engine_service.engine.outputs import RequestOutput
from engine_service.engine.sampling_params import SamplingParams

Prompt = str | dict


class LLM:
    def __init__(self, model: str = "smollm2-135m", config: EngineConfig | None = None, **kwargs):
        self.engine = LLMEngine(config or EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                if isinstance(prompt, dict):
                    if "prompt_token_ids" not in prompt:
                        raise ValueError("prompt: a dict prompt needs 'prompt_token_ids'")
                    prompt = prompt["prompt_token_ids"]
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finals: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finals[rid] for rid in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None, **kwargs) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params, **kwargs)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests")
