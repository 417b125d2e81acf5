// GET /v1/models on this origin: the model's name, its voices, and whether its weights are random.

export async function fetchModel(apiKey) {
  const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
  const response = await fetch("/v1/models", { headers });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const message = body.error && body.error.message ? body.error.message : `HTTP ${response.status}`;
    throw new Error(message);
  }
  return body.data && body.data[0];
}
