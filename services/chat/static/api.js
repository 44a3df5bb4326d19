// The product API over fetch: the API key on every call, JSON errors as ApiError.

import { apiError } from '/static/stream.js';

const auth = { key: '', onUnauthorized: () => {} };

/** The key to send, and what to do when the server refuses it (401). */
export function useKey(key, onUnauthorized) {
  auth.key = key;
  auth.onUnauthorized = onUnauthorized;
}

export function uuid() {
  if (crypto.randomUUID) return crypto.randomUUID(); // secure contexts only
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const h = [...b].map((x) => x.toString(16).padStart(2, '0')).join('');
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

/** A fetch with the API key; a 401 calls onUnauthorized. Never throws for an HTTP status. */
export async function api(path, { method = 'GET', body, headers = {}, signal } = {}) {
  const all = { Authorization: `Bearer ${auth.key}`, ...headers };
  if (body !== undefined) all['Content-Type'] = 'application/json';
  const response = await fetch(path, { method, headers: all, body: body === undefined ? undefined : JSON.stringify(body), signal });
  if (response.status === 401) auth.onUnauthorized();
  return response;
}

/** The JSON body of a successful call; throws ApiError otherwise. */
export async function apiJson(path, options) {
  const response = await api(path, options);
  if (!response.ok) throw await apiError(response);
  return response.json();
}

export function streamHeaders(lastEventId, extra = {}) {
  return { Accept: 'text/event-stream', 'Last-Event-ID': String(lastEventId), ...extra };
}
