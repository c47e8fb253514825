import pytest

from tests.server.utils import API_KEY, RemoteServer

# The default model, eager (no compile: fast start), small context and KV cache.
MAIN_SERVER_ARGS = ["--enforce-eager", "--max-model-len", "1024", "--num-kv-blocks", "400",
                    "--max-num-seqs", "64", "--api-key", API_KEY,
                    "--max-request-body-bytes", str(2**20)]


@pytest.fixture(scope="session")
def server():
    srv = RemoteServer(MAIN_SERVER_ARGS)
    yield srv
    srv.close()


@pytest.fixture(scope="session")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    import httpx
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def tokenizer():
    from compilelm.models.loader import resolve_model
    from compilelm.models.tokenizer import load_tokenizer
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="session")
def model_name(client):
    return client.models.list().data[0].id
