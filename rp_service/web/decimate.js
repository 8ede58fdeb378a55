// Min/max decimation: what a line chart needs to look the same with far fewer points.
//
// The x range [x0, x1] is cut into `columns` equal buckets (one per pixel column). In each
// bucket the first point, the lowest, the highest and the last are kept, in their order, so
// every spike stays visible and the segments between buckets join where they did. 100,000
// points on an 800-pixel chart become at most 3,200. Points whose y is not a finite number
// (a null valid_loss) and points outside [x0, x1] are skipped.
//
// xs must be ascending. Returns the kept indices, ascending, as an Int32Array.
export function decimateMinMax(xs, ys, n, x0, x1, columns) {
  const out = new Int32Array(Math.min(n, 4 * Math.max(1, columns)));
  let kept = 0;
  const span = x1 - x0;
  const scale = span > 0 ? columns / span : 0;
  let bucket = -1;
  let first = -1;
  let low = -1;
  let high = -1;
  let last = -1;
  const flush = () => {
    if (first < 0) return;
    // The four indices in ascending order, without repeats.
    const four = [first, low, high, last].sort((a, b) => a - b);
    for (let k = 0; k < 4; k++) {
      if (k === 0 || four[k] !== four[k - 1]) out[kept++] = four[k];
    }
  };
  for (let i = 0; i < n; i++) {
    const x = xs[i];
    const y = ys[i];
    if (!Number.isFinite(y) || x < x0 || x > x1) continue;
    const b = Math.min(columns - 1, Math.floor((x - x0) * scale));
    if (b !== bucket) {
      flush();
      bucket = b;
      first = low = high = last = i;
      continue;
    }
    if (y < ys[low]) low = i;
    if (y > ys[high]) high = i;
    last = i;
  }
  flush();
  return out.subarray(0, kept);
}
