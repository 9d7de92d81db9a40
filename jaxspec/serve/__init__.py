"""`jaxspec serve`: an OpenAI-compatible HTTP server over the one engine (docs/serving.md).

    protocol.py      the requests and responses (pydantic), their mapping onto SamplingParams
    errors.py        OpenAI's error shape, and what each refusal answers
    async_engine.py  the engine driven by one thread; requests submitted and streamed from asyncio
    metrics.py       Prometheus metrics
    responses.py     engine output as completion / chat completion bodies and stream chunks
    app.py           the FastAPI routes (`build_app`)
    server.py        uvicorn: in the foreground until a signal, or in a thread
    cli.py           `jaxspec serve` options and entry
"""
