// The front end of workbench.widgets.table.DataTable: draws the page of rows the kernel sends, and sends back
// what the user does (sort by a header, turn a page, click a row, copy a name). Sorting and paging run in the
// kernel, so a table of 100k rows costs the browser one page.

function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    return navigator.clipboard.writeText(text);
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.appendChild(area);
  area.select();
  document.execCommand("copy");
  area.remove();
  return Promise.resolve();
}

// Two overlapping sheets, drawn in the text colour (no icon font needed).
const COPY_ICON = '<svg width="11" height="11" viewBox="0 0 16 16" aria-hidden="true"><rect x="5" y="5" width="9" height="9" rx="1" fill="none" stroke="currentColor" stroke-width="1.6"/><path d="M3 11V3a1 1 0 0 1 1-1h7" fill="none" stroke="currentColor" stroke-width="1.6"/></svg>';

function button(label, title, className) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.title = title;
  b.className = className;
  return b;
}

function render({ model, el }) {
  el.classList.add("wb-datatable");
  const note = document.createElement("div");
  note.className = "wb-note wb-datatable-note";
  const scroller = document.createElement("div");
  scroller.className = "wb-datatable-scroll";
  const table = document.createElement("table");
  table.className = "wb-table";
  scroller.appendChild(table);
  const pager = document.createElement("div");
  pager.className = "wb-datatable-pager";
  const first = button("«", "first page", "wb-page-first");
  const prev = button("‹", "previous page", "wb-page-prev");
  const where = document.createElement("span");
  where.className = "wb-page-where";
  const next = button("›", "next page", "wb-page-next");
  const last = button("»", "last page", "wb-page-last");
  pager.append(first, prev, where, next, last);
  el.append(note, scroller, pager);

  const pages = () => Math.max(1, Math.ceil(model.get("total") / Math.max(1, model.get("page_size"))));
  const goTo = (page) => {
    const target = Math.min(Math.max(0, page), pages() - 1);
    if (target !== model.get("page")) {
      model.set("page", target);
      model.save_changes();
    }
  };
  first.onclick = () => goTo(0);
  prev.onclick = () => goTo(model.get("page") - 1);
  next.onclick = () => goTo(model.get("page") + 1);
  last.onclick = () => goTo(pages() - 1);

  let focusKey = null;  // the row an arrow key moved to: focused again once the page is redrawn

  function draw() {
    const columns = model.get("columns");
    const cells = model.get("cells");
    const keys = model.get("row_keys");
    const total = model.get("total");
    const page = model.get("page");
    const size = Math.max(1, model.get("page_size"));
    const sortColumn = model.get("sort_column");
    const descending = model.get("sort_descending");
    const selected = model.get("selected");
    const copyable = model.get("copyable");
    el.classList.toggle("wb-selectable", !!model.get("selectable"));
    note.textContent = model.get("note");
    note.style.display = model.get("note") ? "" : "none";
    table.replaceChildren();
    if (!columns.length) {
      pager.style.display = "none";
      return;
    }
    const head = document.createElement("thead");
    const headRow = document.createElement("tr");
    columns.forEach((column) => {
      const th = document.createElement("th");
      th.dataset.column = column.name;
      th.textContent = column.label;
      th.title = `sort by ${column.label || column.name}`;
      if (column.numeric) th.classList.add("num");
      if (column.name === sortColumn) {
        th.classList.add(descending ? "wb-sorted-desc" : "wb-sorted-asc");
        th.setAttribute("aria-sort", descending ? "descending" : "ascending");
      }
      th.tabIndex = 0;
      th.onclick = () => {
        const again = column.name === model.get("sort_column");
        model.set("sort_descending", again ? !model.get("sort_descending") : !!column.numeric);
        model.set("sort_column", column.name);
        model.save_changes();
      };
      th.onkeydown = (event) => { if (event.key === "Enter" || event.key === " ") { event.preventDefault(); th.onclick(); } };
      headRow.appendChild(th);
    });
    head.appendChild(headRow);
    const body = document.createElement("tbody");
    cells.forEach((row, r) => {
      const tr = document.createElement("tr");
      tr.dataset.key = keys[r];
      if (keys[r] === selected) tr.classList.add("wb-selected");
      row.forEach((text, c) => {
        const td = document.createElement("td");
        if (columns[c].numeric) td.classList.add("num");
        const span = document.createElement("span");
        span.className = "wb-cell";
        span.textContent = text;
        td.title = text;
        td.appendChild(span);
        if (c === 0 && copyable) {
          const copy = button("", `copy ${keys[r]}`, "wb-copy-name");
          copy.innerHTML = COPY_ICON;
          copy.onclick = (event) => {
            event.stopPropagation();
            copyText(keys[r]).then(() => {
              copy.textContent = "✓";
              setTimeout(() => { copy.innerHTML = COPY_ICON; }, 1200);
            });
          };
          td.prepend(copy);
        }
        tr.appendChild(td);
      });
      if (model.get("selectable")) {
        tr.tabIndex = 0;
        tr.onclick = () => {
          model.set("selected", keys[r]);
          model.save_changes();
        };
        tr.onkeydown = (event) => {
          if (event.key === "Enter") tr.onclick();
          // Arrow keys pick the row above or below (the page is redrawn: the new row gets the focus there).
          const step = event.key === "ArrowDown" ? 1 : event.key === "ArrowUp" ? -1 : 0;
          if (step && keys[r + step] !== undefined) {
            event.preventDefault();
            focusKey = keys[r + step];
            model.set("selected", focusKey);
            model.save_changes();
          }
        };
      }
      body.appendChild(tr);
    });
    table.append(head, body);
    if (focusKey !== null) {
      const row = [...body.rows].find((tr) => tr.dataset.key === focusKey);
      if (row) { row.focus(); focusKey = null; }
    }
    const start = total ? page * size + 1 : 0;
    const end = Math.min(total, (page + 1) * size);
    where.textContent = `${start.toLocaleString("en-US")}–${end.toLocaleString("en-US")} of ${total.toLocaleString("en-US")} ${model.get("noun")} · page ${(page + 1).toLocaleString("en-US")} of ${pages().toLocaleString("en-US")}`;
    first.disabled = prev.disabled = page <= 0;
    next.disabled = last.disabled = page >= pages() - 1;
    pager.style.display = total > size ? "" : "none";
  }

  // One update from the kernel changes several traits at once: draw once for all of them.
  let queued = false;
  const schedule = () => {
    if (!queued) {
      queued = true;
      queueMicrotask(() => { queued = false; draw(); });
    }
  };
  const traits = ["columns", "cells", "row_keys", "total", "page", "page_size", "sort_column", "sort_descending", "selected", "note", "noun", "copyable", "selectable"];
  traits.forEach((name) => model.on(`change:${name}`, schedule));
  draw();
  return () => traits.forEach((name) => model.off(`change:${name}`, schedule));
}

export default { render };
