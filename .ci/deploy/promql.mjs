// Reads a JSON array of PromQL expressions on stdin and prints, for each, what
// .ci/deploy/check.py checks: the vector selectors (metric name, label names of the
// matchers, equality matchers' values), the label lists of by/without/on/ignoring with
// the selectors in their scope, and parse errors. Parser: @prometheus-io/lezer-promql,
// the grammar of Prometheus' own web UI (pinned in package.json).
import { parser } from '@prometheus-io/lezer-promql';

const input = JSON.parse(await new Promise((resolve) => {
  let text = '';
  process.stdin.on('data', (chunk) => { text += chunk; });
  process.stdin.on('end', () => resolve(text));
}));

function analyse(expr) {
  const tree = parser.parse(expr);
  const text = (node) => expr.slice(node.from, node.to);
  const errors = [];
  const selectors = [];
  const groupings = [];
  const unquote = (s) => JSON.parse(s.startsWith("'") ? '"' + s.slice(1, -1).replace(/"/g, '\\"') + '"' : s.replace(/^`|`$/g, '"'));

  function selectorsIn(node) {
    const found = [];
    const c = node.cursor();
    const end = node.to;
    do {
      if (c.from >= end) break;
      if (c.name === 'VectorSelector') {
        const id = c.node.getChild('Identifier');
        if (id) found.push(text(id));
      }
    } while (c.next());
    return found;
  }

  tree.iterate({
    enter(ref) {
      const node = ref.node;
      if (ref.type.isError) {
        errors.push(`syntax error at ${ref.from}: ${JSON.stringify(expr.slice(Math.max(0, ref.from - 20), ref.from + 20))}`);
      } else if (ref.name === 'VectorSelector') {
        const id = node.getChild('Identifier');
        const matchers = [];
        const matcherList = node.getChild('LabelMatchers');
        if (matcherList) {
          for (const m of matcherList.getChildren('UnquotedLabelMatcher')) {
            const name = m.getChild('LabelName');
            const op = m.getChild('MatchOp');
            const value = m.getChild('StringLiteral');
            matchers.push({ label: text(name), op: text(op), value: value ? unquote(text(value)) : null });
          }
          if (matcherList.getChildren('QuotedLabelMatcher').length || matcherList.getChildren('QuotedLabelName').length) {
            errors.push('quoted label names are not checked; write them unquoted');
          }
        }
        selectors.push({ name: id ? text(id) : null, matchers });
      } else if (ref.name === 'AggregateExpr') {
        const modifier = node.getChild('AggregateModifier');
        if (modifier) {
          const labels = (modifier.getChild('GroupingLabels')?.getChildren('LabelName') ?? []).map(text);
          groupings.push({ kind: modifier.getChild('By') ? 'by' : 'without', labels, scope: selectorsIn(node) });
        }
      } else if (ref.name === 'MatchingModifierClause') {
        // on(...)/ignoring(...) and group_left(...)/group_right(...) of a binary expression:
        // their labels come from either side, so the scope is the whole binary expression.
        const binary = node.parent;
        let kind = null;
        for (let child = node.firstChild; child; child = child.nextSibling) {
          if (child.name === 'GroupingLabels') {
            groupings.push({ kind, labels: child.getChildren('LabelName').map(text), scope: selectorsIn(binary) });
          } else {
            kind = text(child);
          }
        }
      }
    },
  });
  return { errors, selectors, groupings };
}

process.stdout.write(JSON.stringify(input.map(analyse)));
