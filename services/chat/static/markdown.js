// Answers are Markdown: marked turns the text into HTML, DOMPurify keeps only harmless markup
// (no script, no event handlers, no javascript: links), highlight.js colours code. Raw HTML in
// an answer is shown as text, never parsed, and images become links, so a model's output can
// neither run script nor make the browser fetch a URL of its choosing.

import hljs from '/static/vendor/highlight.min.js';
import { Marked } from '/static/vendor/marked.esm.js';
import DOMPurify from '/static/vendor/purify.es.mjs';

const ESCAPES = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };
const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => ESCAPES[c]);

const marked = new Marked({
  gfm: true,
  breaks: true, // a model's single line breaks (a poem, an address) are kept as it wrote them
  renderer: {
    html: ({ text }) => escapeHtml(text),
    image: ({ href, text }) => `<a href="${escapeHtml(href)}">${escapeHtml(text || href)}</a>`,
  },
});

const PURIFY = {
  ALLOWED_TAGS: ['a', 'blockquote', 'br', 'code', 'del', 'em', 'h1', 'h2', 'h3', 'h4', 'h5', 'h6', 'hr', 'li', 'ol', 'p',
    'pre', 'span', 'strong', 'table', 'tbody', 'td', 'th', 'thead', 'tr', 'ul'],
  ALLOWED_ATTR: ['href', 'title', 'class', 'align', 'start'],
  RETURN_DOM_FRAGMENT: true,
};
DOMPurify.addHook('afterSanitizeAttributes', (node) => {
  if (node.tagName === 'A') {
    node.setAttribute('target', '_blank');
    node.setAttribute('rel', 'noopener noreferrer nofollow');
  }
});

/**
 * Renders `source` into `target`. `isFinal`: the text is complete, so code blocks without a
 * language are highlighted too (guessing one tries every language: not on every streamed frame).
 */
export function renderMarkdown(target, source, isFinal) {
  target.replaceChildren(DOMPurify.sanitize(marked.parse(source), PURIFY));
  for (const code of target.querySelectorAll('pre > code')) {
    if (isFinal || /\blanguage-/.test(code.className)) hljs.highlightElement(code);
    const pre = code.parentElement;
    const block = codeBlock(code);
    pre.replaceWith(block);
    block.append(pre);
  }
}

/** A fenced code block with its language and a Copy button above it. */
function codeBlock(code) {
  const block = document.createElement('div');
  block.className = 'code-block';
  const bar = document.createElement('div');
  bar.className = 'code-bar';
  const language = document.createElement('span');
  language.textContent = (code.className.match(/\blanguage-([\w+#.-]+)/) || [])[1] || '';
  const copy = document.createElement('button');
  copy.type = 'button';
  copy.className = 'link copy-code';
  copy.textContent = 'Copy';
  bar.append(language, copy);
  block.append(bar);
  return block;
}

async function copyCode(button) {
  const text = button.closest('.code-block').querySelector('code').textContent;
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = 'Copied';
  } catch {
    button.textContent = 'Copy failed'; // no clipboard access (an insecure origin)
  }
  setTimeout(() => { button.textContent = 'Copy'; }, 1500);
}

document.addEventListener('click', (event) => {
  const button = event.target.closest('.copy-code');
  if (button) copyCode(button);
});
