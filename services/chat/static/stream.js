// Reading a reply's SSE stream with fetch (EventSource cannot send Authorization), and following
// a reply to its end across dropped connections with Last-Event-ID.

const BACKOFF_BASE_MS = 500;
const BACKOFF_CAP_MS = 8000;
// The server sends a keep-alive comment every 15 s: this long without a byte means a dead link.
const SILENCE_LIMIT_MS = 40000;
// Statuses worth asking again (after Retry-After) while resuming; anything else ends the reply.
const RETRYABLE = new Set([409, 429, 500, 502, 503, 504]);

export class ApiError extends Error {
  constructor(status, message, code, retryAfterS) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryAfterS = retryAfterS;
  }
}

export function retryAfterSeconds(value) {
  if (!value) return 0;
  const seconds = Number(value);
  if (Number.isFinite(seconds)) return Math.max(0, seconds);
  const at = Date.parse(value);
  return Number.isNaN(at) ? 0 : Math.max(0, (at - Date.now()) / 1000);
}

/** The `{"error": {...}}` body of a failed response as an ApiError (whatever the body is). */
export async function apiError(response) {
  let message = `${response.status} ${response.statusText || 'error'}`;
  let code = `http_${response.status}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) {
      message = body.error.message;
      code = body.error.code || code;
    }
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, message, code, retryAfterSeconds(response.headers.get('Retry-After')));
}

/**
 * The events of an SSE body as they arrive: {id, event, data} with data parsed as JSON.
 * Comments (keep-alives) are skipped; `onBytes` is called for every chunk read.
 */
export async function* sseEvents(response, onBytes = () => {}) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  let fields = { id: '', event: '', data: [] };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      onBytes();
      buffer += decoder.decode(value, { stream: true });
      // A trailing '\r' may be the first half of '\r\n': keep it for the next chunk.
      const cut = buffer.endsWith('\r') ? buffer.length - 1 : buffer.length;
      const lines = buffer.slice(0, cut).split(/\r\n|\r|\n/);
      buffer = lines.pop() + buffer.slice(cut);
      for (const line of lines) {
        if (line === '') {
          if (fields.data.length) {
            const event = parseEvent(fields);
            if (event) yield event;
          }
          fields = { id: '', event: '', data: [] };
        } else if (!line.startsWith(':')) {
          const colon = line.indexOf(':');
          const name = colon < 0 ? line : line.slice(0, colon);
          let value = colon < 0 ? '' : line.slice(colon + 1);
          if (value.startsWith(' ')) value = value.slice(1);
          if (name === 'data') fields.data.push(value);
          else if (name === 'event') fields.event = value;
          else if (name === 'id') fields.id = value;
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function parseEvent(fields) {
  try {
    return { id: Number(fields.id) || 0, event: fields.event || 'message', data: JSON.parse(fields.data.join('\n')) };
  } catch {
    console.warn('tandem: an SSE event with data that is not JSON was skipped', fields);
    return null;
  }
}

/** Resolves after `ms`, at once when the browser comes back online, or when `signal` aborts. */
function pause(ms, signal) {
  return new Promise((resolve) => {
    const finish = () => {
      clearTimeout(timer);
      window.removeEventListener('online', finish);
      signal.removeEventListener('abort', finish);
      resolve();
    };
    const timer = setTimeout(finish, ms);
    window.addEventListener('online', finish);
    signal.addEventListener('abort', finish);
  });
}

/**
 * Follows one reply to its `done`, `error` or `moderated` event.
 *
 * `start(lastEventId, signal)` opens the first response (the send or regenerate POST); it is called
 * again, with the same Idempotency-Key, while the reply's message id is still unknown.
 * `resume(messageId, lastEventId, signal)` reopens the stream after a drop. Every event is handed
 * to `on` at most once, in id order: the last handled id travels as Last-Event-ID, and anything at
 * or below it is skipped. Returns 'done', 'error', 'moderated', 'failed' or 'abandoned'.
 *
 * `on`: meta(data), delta(data), done(data), error(data), moderated(data), failed(ApiError, {atStart}),
 * reconnecting(delayMs, attempt), connected().
 */
export async function followReply({ start, resume, messageId = '', lastEventId = 0, on, signal }) {
  const reply = { messageId, lastEventId };
  let attempt = 0;
  let isFirst = true;
  while (!signal.aborted) {
    const link = new AbortController();
    const abortLink = () => link.abort();
    signal.addEventListener('abort', abortLink);
    // An offline browser's connections are dead even when no error says so yet: drop at once.
    window.addEventListener('offline', abortLink);
    let progressed = false;
    let delayMs = 0;
    try {
      const response = reply.messageId
        ? await resume(reply.messageId, reply.lastEventId, link.signal)
        : await start(reply.lastEventId, link.signal);
      if (!response.ok) {
        const error = await apiError(response);
        // A refused send or regenerate is the caller's to show; so is any final refusal.
        if (isFirst || !RETRYABLE.has(error.status)) {
          on.failed(error, { atStart: isFirst });
          return 'failed';
        }
        delayMs = error.retryAfterS * 1000;
      } else {
        reply.messageId = reply.messageId || response.headers.get('X-Message-Id') || '';
        on.connected();
        const ending = await readEvents(response, reply, on, link);
        if (ending) return ending;
        progressed = reply.lastEventId > 0;
      }
    } catch (err) {
      if (signal.aborted) return 'abandoned';
      // A network failure, a dropped or silent connection: try again below.
    } finally {
      signal.removeEventListener('abort', abortLink);
      window.removeEventListener('offline', abortLink);
      link.abort();
    }
    if (signal.aborted) break;
    isFirst = false;
    if (progressed) attempt = 0;
    const backoffMs = Math.min(BACKOFF_CAP_MS, BACKOFF_BASE_MS * 2 ** attempt) * (0.8 + 0.4 * Math.random());
    attempt += 1;
    delayMs = Math.max(delayMs, backoffMs);
    on.reconnecting(delayMs, attempt);
    await pause(delayMs, signal);
  }
  return 'abandoned';
}

function deliver(on, event) {
  const handler = on[event.event];
  if (!handler) return;
  try {
    handler(event.data);
  } catch (err) {
    console.error('tandem: rendering an event failed', event, err); // a page bug, not a network one
  }
}

/** Hands on the response's new events; 'done', 'error' or 'moderated' when the reply ended, else null. */
async function readEvents(response, reply, on, link) {
  let silence = setTimeout(() => link.abort(), SILENCE_LIMIT_MS);
  const heard = () => {
    clearTimeout(silence);
    silence = setTimeout(() => link.abort(), SILENCE_LIMIT_MS);
  };
  try {
    for await (const event of sseEvents(response, heard)) {
      if (event.id && event.id <= reply.lastEventId) continue;
      if (event.id) reply.lastEventId = event.id;
      if (event.event === 'meta' && event.data.message_id) reply.messageId = event.data.message_id;
      deliver(on, event);
      if (event.event === 'done' || event.event === 'error' || event.event === 'moderated') return event.event;
    }
    return null;
  } finally {
    clearTimeout(silence);
  }
}
