// GET /v1/models on this origin: each model's name, kind, voices, and whether its weights are random.

export async function fetchModels(apiKey) {
  const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
  const response = await fetch("/v1/models", { headers });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const message = body.error && body.error.message ? body.error.message : `HTTP ${response.status}`;
    throw new Error(message);
  }
  return body.data || [];
}

/** The model a profile talks to: the duplex model for the duplex profile, else the first other one. */
export function modelForProfile(models, duplex) {
  if (duplex) return models.find((m) => m.kind === "duplex") || null;
  return models.find((m) => m.kind !== "duplex") || null;
}
