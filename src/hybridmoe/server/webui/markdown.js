// A small Markdown renderer for model output that builds DOM nodes only.
// Model text never reaches innerHTML: every character ends up in a text node, so raw HTML in a
// reply (`<img src=x onerror=...>`) shows as text. Links keep only http(s)/mailto URLs, and images
// become links (a remote image would be fetched without the user asking).

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
const HEADING = /^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?/;
const LIST_ITEM = /^( *)([-*+]|\d{1,9}[.)])[ \t]+(.*)$/;
const TABLE_SEP = /^ *\|? *:?-+:? *(\| *:?-+:? *)*\|? *$/;
const PUNCT = "\\`*_{}[]()#+-.!|~<>\"'";
const BARE_URL = /^https?:\/\/[^\s<>"]+/;

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function indentOf(line) {
  return line.length - line.trimStart().length;
}

/** The URL if it is an absolute http(s) or mailto URL, else null (javascript:, data:, relative). */
export function safeUrl(raw) {
  try {
    const url = new URL(raw.trim());
    return ["http:", "https:", "mailto:"].includes(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

function link(href, text) {
  const a = el("a");
  a.href = href;
  a.target = "_blank";
  a.rel = "noopener noreferrer nofollow";
  if (typeof text === "string") a.textContent = text;
  return a;
}

// ---- inline ------------------------------------------------------------------------------------

function runLength(src, i, ch) {
  let n = 0;
  while (src[i + n] === ch) n++;
  return n;
}

/** `*em*`, `**strong**`, `_em_`, `__strong__`, `~~del~~` starting at i, or null. */
function matchEmphasis(src, i) {
  const ch = src[i];
  const double = src[i + 1] === ch;
  if (ch === "~" && !double) return null;
  const delim = double ? ch + ch : ch;
  const start = i + delim.length;
  if (start >= src.length || /\s/.test(src[start])) return null;
  if (ch === "_" && i > 0 && /[\p{L}\p{N}]/u.test(src[i - 1])) return null;
  let j = start + 1;
  while (j <= src.length - delim.length) {
    const k = src.indexOf(delim, j);
    if (k < 0) return null;
    const doubledHere = !double && src[k + 1] === ch;
    const closes = !/\s/.test(src[k - 1]) && !doubledHere &&
      !(ch === "_" && /[\p{L}\p{N}]/u.test(src[k + delim.length] || ""));
    if (closes) {
      const tag = ch === "~" ? "del" : double ? "strong" : "em";
      return { tag, inner: src.slice(start, k), end: k + delim.length };
    }
    j = k + (doubledHere ? 2 : 1);
  }
  return null;
}

/** `[text](url "title")` starting at i (src[i] === "["), or null. */
function matchLink(src, i) {
  let depth = 0;
  let j = i;
  for (; j < src.length; j++) {
    const c = src[j];
    if (c === "\\") { j++; continue; }
    if (c === "[") depth++;
    else if (c === "]" && --depth === 0) break;
  }
  if (j >= src.length || src[j + 1] !== "(") return null;
  let k = j + 2;
  depth = 1;
  for (; k < src.length; k++) {
    if (src[k] === "(") depth++;
    else if (src[k] === ")" && --depth === 0) break;
    else if (src[k] === "\n") return null;
  }
  if (k >= src.length) return null;
  const target = src.slice(j + 2, k).trim().replace(/^<(.*)>$/, "$1");
  const url = target.split(/\s+/)[0];
  return { text: src.slice(i + 1, j), url, end: k + 1 };
}

/** Appends the inline nodes of `src` (one paragraph's text) to `parent`. */
export function renderInline(src, parent) {
  let buf = "";
  const flush = () => {
    if (buf) parent.appendChild(document.createTextNode(buf));
    buf = "";
  };
  let i = 0;
  while (i < src.length) {
    const c = src[i];
    if (c === "\\" && i + 1 < src.length && PUNCT.includes(src[i + 1])) {
      buf += src[i + 1];
      i += 2;
      continue;
    }
    if (c === "\n") {
      flush();
      parent.appendChild(el("br"));
      i++;
      continue;
    }
    if (c === "`") {
      const n = runLength(src, i, "`");
      let k = src.indexOf("`".repeat(n), i + n);
      while (k >= 0 && src[k + n] === "`") k = src.indexOf("`".repeat(n), k + runLength(src, k, "`"));
      if (k >= 0) {
        let code = src.slice(i + n, k).replace(/\n/g, " ");
        if (code.length > 2 && code.startsWith(" ") && code.endsWith(" ") && code.trim()) code = code.slice(1, -1);
        flush();
        parent.appendChild(el("code", null, code));
        i = k + n;
        continue;
      }
      buf += "`".repeat(n);
      i += n;
      continue;
    }
    if (c === "*" || c === "_" || c === "~") {
      const m = matchEmphasis(src, i);
      if (m) {
        flush();
        const node = el(m.tag);
        renderInline(m.inner, node);
        parent.appendChild(node);
        i = m.end;
        continue;
      }
      const n = runLength(src, i, c);  // an unmatched run stays literal as a whole
      buf += c.repeat(n);
      i += n;
      continue;
    }
    if (c === "[" || (c === "!" && src[i + 1] === "[")) {
      const image = c === "!";
      const m = matchLink(src, image ? i + 1 : i);
      if (m) {
        flush();
        const href = safeUrl(m.url);
        const holder = href ? link(href) : el("span", "md-unsafe-link");
        if (image) holder.appendChild(document.createTextNode(`[image: ${m.text}]`));
        else renderInline(m.text, holder);
        if (!href) holder.title = "link removed: only http(s) and mailto links are kept";
        parent.appendChild(holder);
        i = m.end;
        continue;
      }
    }
    if (c === "<") {
      const m = /^<(https?:\/\/[^\s<>]+|mailto:[^\s<>]+)>/.exec(src.slice(i));
      const href = m && safeUrl(m[1]);
      if (href) {
        flush();
        parent.appendChild(link(href, m[1]));
        i += m[0].length;
        continue;
      }
    }
    if (c === "h" && (i === 0 || /[\s(]/.test(src[i - 1]))) {
      const m = BARE_URL.exec(src.slice(i));
      if (m) {
        const text = m[0].replace(/[.,;:!?)'\]]+$/, "");
        const href = safeUrl(text);
        if (href) {
          flush();
          parent.appendChild(link(href, text));
          i += text.length;
          continue;
        }
      }
    }
    buf += c;
    i++;
  }
  flush();
}

// ---- blocks ------------------------------------------------------------------------------------

function isTableStart(lines, i) {
  return i + 1 < lines.length && lines[i].includes("|") && lines[i + 1].includes("|") &&
    lines[i + 1].includes("-") && TABLE_SEP.test(lines[i + 1]);
}

function startsBlock(lines, i) {
  const line = lines[i];
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    LIST_ITEM.test(line) || isTableStart(lines, i);
}

function splitRow(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  const cells = [];
  let cur = "";
  for (let i = 0; i < s.length; i++) {
    if (s[i] === "\\" && s[i + 1] === "|") { cur += "|"; i++; continue; }
    if (s[i] === "|") { cells.push(cur.trim()); cur = ""; continue; }
    cur += s[i];
  }
  cells.push(cur.trim());
  return cells;
}

function codeBlock(lang, code) {
  const box = el("div", "code-block");
  const head = el("div", "code-head");
  head.appendChild(el("span", "code-lang", lang || "text"));
  const copy = el("button", "code-copy", "Copy");
  copy.type = "button";
  const codeEl = el("code", null, code);
  copy.addEventListener("click", () => {
    if (navigator.clipboard) {  // secure contexts only (localhost or https)
      navigator.clipboard.writeText(code).then(() => { copy.textContent = "Copied"; }, () => {});
    } else {
      window.getSelection().selectAllChildren(codeEl);  // selected for Ctrl+C instead
    }
  });
  head.appendChild(copy);
  box.appendChild(head);
  const pre = el("pre");
  if (lang) codeEl.dataset.lang = lang;
  pre.appendChild(codeEl);
  box.appendChild(pre);
  return box;
}

function renderTable(lines, i, parent) {
  const head = splitRow(lines[i]);
  const align = splitRow(lines[i + 1]).map((s) =>
    s.startsWith(":") && s.endsWith(":") ? "center" : s.endsWith(":") ? "right" : s.startsWith(":") ? "left" : "");
  const wrap = el("div", "table-wrap");
  const table = el("table");
  const row = (cells, tag) => {
    const tr = el("tr");
    head.forEach((_, c) => {
      const cell = el(tag);
      if (align[c]) cell.style.textAlign = align[c];
      renderInline(cells[c] ?? "", cell);
      tr.appendChild(cell);
    });
    return tr;
  };
  const thead = el("thead");
  thead.appendChild(row(head, "th"));
  table.appendChild(thead);
  const tbody = el("tbody");
  i += 2;
  while (i < lines.length && lines[i].trim() && lines[i].includes("|")) {
    tbody.appendChild(row(splitRow(lines[i]), "td"));
    i++;
  }
  table.appendChild(tbody);
  wrap.appendChild(table);
  parent.appendChild(wrap);
  return i;
}

function renderList(lines, i, parent) {
  const first = LIST_ITEM.exec(lines[i]);
  const base = first[1].length;
  const ordered = /\d/.test(first[2]);
  const list = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
  while (i < lines.length) {
    const m = LIST_ITEM.exec(lines[i]);
    if (!m || m[1].length > base + 1 || /\d/.test(m[2]) !== ordered) break;
    const contentIndent = m[0].length - m[3].length;
    const itemLines = [m[3]];
    let loose = false;
    i++;
    while (i < lines.length) {
      const line = lines[i];
      if (!line.trim()) {
        let j = i + 1;
        while (j < lines.length && !lines[j].trim()) j++;
        if (j < lines.length && indentOf(lines[j]) >= contentIndent) {
          itemLines.push(...lines.slice(i, j).map(() => ""));
          loose = true;
          i = j;
          continue;
        }
        break;
      }
      const ind = indentOf(line);
      if (ind > base + 1) {
        itemLines.push(line.slice(Math.min(ind, contentIndent)));
        i++;
        continue;
      }
      if (startsBlock(lines, i)) break;
      itemLines.push(line.trim());  // lazy continuation of the item's paragraph
      i++;
    }
    const li = el("li");
    renderBlocks(itemLines, li);
    if (!loose) {
      for (const p of [...li.children].filter((c) => c.tagName === "P")) p.replaceWith(...p.childNodes);
    }
    list.appendChild(li);
    let j = i;
    while (j < lines.length && !lines[j].trim()) j++;
    if (j === i) continue;
    const next = j < lines.length && LIST_ITEM.exec(lines[j]);
    if (!next || next[1].length > base + 1 || /\d/.test(next[2]) !== ordered) break;
    i = j;
  }
  parent.appendChild(list);
  return i;
}

function renderBlocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) { i++; continue; }
    let m = FENCE.exec(line);
    if (m) {
      const fence = m[1];
      const code = [];
      i++;
      while (i < lines.length) {
        const close = lines[i].trim();
        if (close.startsWith(fence) && close.replaceAll(fence[0], "") === "") break;
        code.push(lines[i]);
        i++;
      }
      i++;  // the closing fence; an unclosed one (still streaming) runs to the end
      parent.appendChild(codeBlock(m[2], code.join("\n")));
      continue;
    }
    if ((m = HEADING.exec(line))) {
      const h = el(`h${m[1].length}`);
      renderInline(m[2], h);
      parent.appendChild(h);
      i++;
      continue;
    }
    if (RULE.test(line)) {
      parent.appendChild(el("hr"));
      i++;
      continue;
    }
    if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && QUOTE.test(lines[i])) inner.push(lines[i++].replace(QUOTE, ""));
      const quote = el("blockquote");
      renderBlocks(inner, quote);
      parent.appendChild(quote);
      continue;
    }
    if (LIST_ITEM.test(line)) {
      i = renderList(lines, i, parent);
      continue;
    }
    if (isTableStart(lines, i)) {
      i = renderTable(lines, i, parent);
      continue;
    }
    const para = [line.trim()];
    i++;
    while (i < lines.length && lines[i].trim() && !startsBlock(lines, i)) para.push(lines[i++].trim());
    const p = el("p");
    renderInline(para.join("\n"), p);
    parent.appendChild(p);
  }
}

/** Model text -> a DocumentFragment of safe nodes (no HTML is ever parsed). */
export function renderMarkdown(text) {
  const frag = document.createDocumentFragment();
  renderBlocks(String(text ?? "").replace(/\r\n?/g, "\n").split("\n"), frag);
  return frag;
}
