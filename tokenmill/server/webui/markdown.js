// Markdown as DOM nodes, never as HTML: model output reaches the page only through
// createElement and text nodes, so `<script>` or `<img onerror=...>` in an answer is shown as
// text. Covers what chat answers use: fenced code blocks (an unclosed fence, while streaming,
// runs to the end), headings, bulleted and numbered lists, block quotes, rules, paragraphs,
// and inside them `inline code`, **bold** and *italic*. Links stay plain text.
"use strict";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
// Inline spans, first match wins: code (any run of backticks, closed by the same run), bold,
// italic. Bold and italic need a non-space just inside their markers, as in CommonMark; bold
// ends at the last of a run of stars, so **bold *italic*** nests.
const INLINE = new RegExp([
  "(`+)([\\s\\S]*?[^`])\\1(?!`)",
  "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*(?!\\*)",
  "__(?=\\S)([\\s\\S]*?\\S)__(?!\\w)",
  "\\*([^\\s*](?:[^*]*[^\\s*])?)\\*",
  "(?<![\\w])_(?=\\S)([^_]*?\\S)_(?!\\w)",
].join("|"), "g");

function element(tag, children) {
  const el = document.createElement(tag);
  el.append(...children);
  return el;
}

// Text with inline spans, as a list of nodes.
function inlineNodes(text) {
  const nodes = [];
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) nodes.push(document.createTextNode(text.slice(last, m.index)));
    last = m.index + m[0].length;
    if (m[1] !== undefined) {
      const code = document.createElement("code");
      // One space padding each side lets code start or end with a backtick.
      code.textContent = m[2].replace(/^ (.*) $/s, "$1");
      nodes.push(code);
    } else if (m[3] !== undefined || m[4] !== undefined) {
      nodes.push(element("strong", inlineNodes(m[3] ?? m[4])));
    } else {
      nodes.push(element("em", inlineNodes(m[5] ?? m[6])));
    }
  }
  if (last < text.length) nodes.push(document.createTextNode(text.slice(last)));
  return nodes;
}

// A fenced code block from lines[start] (the opening fence); returns [node, next line].
function codeBlock(lines, start, fence) {
  const marker = fence[1];
  const body = [];
  let i = start + 1;
  while (i < lines.length && !(lines[i].trim().startsWith(marker)
                               && /^[`~]+$/.test(lines[i].trim()))) {
    body.push(lines[i]);
    i++;
  }
  const code = document.createElement("code");
  if (fence[2]) code.dataset.lang = fence[2];
  code.textContent = body.join("\n");
  return [element("pre", [code]), i + 1];
}

// A list from lines[start]: items of the same kind (bullets or numbers); a line indented
// under an item continues it. Returns [node, next line].
function listBlock(lines, start) {
  const ordered = /\d/.test(ITEM.exec(lines[start])[1]);
  const list = document.createElement(ordered ? "ol" : "ul");
  const first = parseInt(ITEM.exec(lines[start])[1], 10);
  if (ordered && first !== 1) list.start = first;
  let i = start;
  while (i < lines.length) {
    const m = ITEM.exec(lines[i]);
    if (!m || /\d/.test(m[1]) !== ordered || FENCE.test(lines[i])) break;
    const text = [m[2]];
    i++;
    while (i < lines.length && /^\s{2,}\S/.test(lines[i]) && !ITEM.test(lines[i])) {
      text.push(lines[i].trim());
      i++;
    }
    list.appendChild(element("li", inlineNodes(text.join("\n"))));
    while (i < lines.length && !lines[i].trim() && ITEM.test(lines[i + 1] || "")) i++;
  }
  return [list, i];
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || ITEM.test(line) || QUOTE.test(line)
    || RULE.test(line);
}

// The block at lines[i] (not blank); returns [node, next line].
function block(lines, i) {
  const line = lines[i];
  const fence = FENCE.exec(line);
  if (fence) return codeBlock(lines, i, fence);
  if (RULE.test(line)) return [document.createElement("hr"), i + 1];
  const heading = HEADING.exec(line);
  if (heading) return [element("h" + heading[1].length, inlineNodes(heading[2])), i + 1];
  if (ITEM.test(line)) return listBlock(lines, i);
  if (QUOTE.test(line)) {
    const quoted = [];
    while (i < lines.length && QUOTE.test(lines[i])) quoted.push(QUOTE.exec(lines[i++])[1]);
    return [element("blockquote", markdownNodes(quoted.join("\n"))), i];
  }
  const para = [line];
  i++;
  while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) para.push(lines[i++]);
  return [element("p", inlineNodes(para.join("\n"))), i];
}

// The blocks of a markdown text, as a list of nodes.
function markdownNodes(text) {
  const lines = text.split(/\r?\n/);
  const nodes = [];
  let i = 0;
  while (i < lines.length) {
    if (!lines[i].trim()) { i++; continue; }
    const [node, next] = block(lines, i);
    nodes.push(node);
    i = next;
  }
  return nodes;
}

// Show a markdown text in el, replacing what it held.
function renderMarkdown(text, el) {
  el.replaceChildren(...markdownNodes(text));
}
