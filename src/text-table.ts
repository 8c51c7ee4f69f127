/** Rows of aligned columns, as `idem status` and `idem list` print them. */
export interface TextTable {
  /**
   * One row, its cells padded to the column widths and two spaces apart; the last cell is not
   * padded (it may run long). `paint` colours a cell after padding, so colour codes never count
   * toward a width.
   */
  line(cells: readonly string[], paint?: (column: number, padded: string) => string): string;
}

/** Aligns every row given (the header among them): each column as wide as its widest cell. */
export function textTable(rows: ReadonlyArray<readonly string[]>): TextTable {
  const columns = Math.max(0, ...rows.map((r) => r.length));
  const widths = Array.from({ length: columns }, (_, i) => Math.max(0, ...rows.map((r) => (r[i] ?? '').length)));
  return {
    line: (cells, paint = (_, s) => s) => cells.map((cell, i) => paint(i, i === cells.length - 1 ? cell : cell.padEnd(widths[i]!))).join('  '),
  };
}
