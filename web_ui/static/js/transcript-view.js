// The transcript list: one entry per conversation item, text streaming in as it arrives.

export class TranscriptView {
  constructor(list) {
    this.list = list;
    this.entries = new Map(); // itemId -> {li, text, meta}
  }

  entry(itemId, role) {
    let entry = this.entries.get(itemId);
    if (!entry) {
      const li = document.createElement("li");
      li.className = `turn ${role}`;
      li.dataset.itemId = itemId;
      li.dataset.role = role;
      const who = document.createElement("span");
      who.className = "who";
      who.textContent = role === "user" ? "You" : "Assistant";
      const text = document.createElement("span");
      text.className = "text";
      const meta = document.createElement("span");
      meta.className = "meta";
      li.append(who, text, meta);
      this.list.append(li);
      entry = { li, text, meta, notes: {} };
      this.entries.set(itemId, entry);
    }
    return entry;
  }

  update({ itemId, role, text, delta, final, interrupted, playedMs }) {
    const entry = this.entry(itemId, role);
    if (delta) entry.text.textContent += delta;
    if (text !== undefined && text !== "") entry.text.textContent = text;
    if (role === "user" && final && !entry.text.textContent) entry.text.textContent = "(spoken audio)";
    if (final) entry.li.classList.add("final");
    if (interrupted) {
      entry.li.classList.add("interrupted");
      this.note(itemId, "cut", `interrupted after ${(playedMs / 1000).toFixed(2)} s`);
    }
    entry.li.scrollIntoView({ block: "nearest" });
  }

  note(itemId, key, value) {
    const entry = this.entries.get(itemId);
    if (!entry) return;
    entry.notes[key] = value;
    entry.meta.textContent = Object.values(entry.notes).join(" · ");
  }

  clear() {
    this.list.replaceChildren();
    this.entries.clear();
  }
}
