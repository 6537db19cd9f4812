# One image for every gatekeeper process in docker-compose.yml (workers, replayer, producer).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gatekeeper ./gatekeeper
COPY workers ./workers
COPY config ./config
RUN pip install --no-cache-dir .
ENV PYTHONUNBUFFERED=1
CMD ["gatekeeper", "--help"]
