// lincheck - linearizability verdict for a recorded ZZ kv history, using Porcupine
// (github.com/anishathalye/porcupine) with a key-value model partitioned by key.
//
//	lincheck [-html out.html] [-timeout 30s] [-json] history.json
//
// Exit status: 0 linearizable, 1 not linearizable, 2 bad input or usage,
// 3 unknown (the -timeout ran out before Porcupine reached a verdict).
// The history format is in docs/linearizability.md.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"

	"github.com/anishathalye/porcupine"
)

// ---- history file ---------------------------------------------------------------------

// Output of a finished operation. A nil *Output marks a pending operation: the client
// gave up (timeout, crash) and cannot know whether the op took effect.
type Output struct {
	Status  string  `json:"status"`            // ok, not_found, mismatch, error
	Value   *string `json:"value,omitempty"`   // get: the value read; mismatch: current value
	Present *bool   `json:"present,omitempty"` // mismatch only: whether the key existed
}

type Record struct {
	Client   int     `json:"client"`
	Call     *int64  `json:"call"`
	Return   *int64  `json:"return"` // null or absent: pending
	Op       string  `json:"op"`     // get, put, delete, cas, append
	Key      *string `json:"key"`
	Value    *string `json:"value,omitempty"`    // put, append: the value; cas: the new value
	Expected *string `json:"expected,omitempty"` // cas: the value required; null: key must be absent
	Output   *Output `json:"output"`
}

type historyFile struct {
	Operations []json.RawMessage `json:"operations"`
}

// ---- model ----------------------------------------------------------------------------

type input struct {
	op       string
	key      string
	value    string
	hasExp   bool // cas: expects the key present with value `expected`
	expected string
}

type output struct {
	pending bool
	status  string
	value   string
	present bool // get ok / mismatch: whether the reply says the key exists
	hasCur  bool // mismatch: the reply carries the current value
}

// state of one key; comparable, so Porcupine's default == equality works.
type state struct {
	present bool
	value   string
}

// step is the sequential specification of execution/apps/kv.py for one key. A pending
// output accepts any result and applies the op's effect: linearizing the op after every
// other one (its return is "after the end") is the same as it never having happened.
func step(s state, in input, out output) (bool, state) {
	if out.status == "error" {
		// kv answers BAD_OP/TOO_LARGE/READ_ONLY before touching state: no effect.
		return true, s
	}
	switch in.op {
	case "get":
		if out.pending {
			return true, s
		}
		if out.status == "not_found" {
			return !s.present, s
		}
		return out.status == "ok" && s.present && s.value == out.value, s
	case "put":
		return out.pending || out.status == "ok", state{true, in.value}
	case "append":
		return out.pending || out.status == "ok", state{true, s.value + in.value}
	case "delete":
		next := state{}
		if out.pending {
			return true, next
		}
		if out.status == "not_found" {
			return !s.present, next
		}
		return out.status == "ok" && s.present, next
	case "cas":
		match := s.present == in.hasExp && (!in.hasExp || s.value == in.expected)
		next := s
		if match {
			next = state{true, in.value}
		}
		if out.pending {
			return true, next
		}
		if out.status == "ok" {
			return match, next
		}
		if out.status != "mismatch" || match {
			return false, next
		}
		if out.hasCur {
			return s.present == out.present && (!s.present || s.value == out.value), next
		}
		return true, next
	}
	return false, s
}

func quote(s string) string { return fmt.Sprintf("%q", s) }

func describeOp(i, o interface{}) string {
	in := i.(input)
	out := o.(output)
	var call string
	switch in.op {
	case "get", "delete":
		call = fmt.Sprintf("%s(%s)", in.op, quote(in.key))
	case "put", "append":
		call = fmt.Sprintf("%s(%s, %s)", in.op, quote(in.key), quote(in.value))
	case "cas":
		exp := "absent"
		if in.hasExp {
			exp = quote(in.expected)
		}
		call = fmt.Sprintf("cas(%s, %s -> %s)", quote(in.key), exp, quote(in.value))
	}
	switch {
	case out.pending:
		return call + " -> ?"
	case in.op == "get" && out.status == "ok":
		return call + " -> " + quote(out.value)
	case out.status == "mismatch" && out.hasCur && out.present:
		return call + " -> mismatch, is " + quote(out.value)
	case out.status == "mismatch" && out.hasCur:
		return call + " -> mismatch, absent"
	}
	return call + " -> " + out.status
}

func describeState(st interface{}) string {
	s := st.(state)
	if !s.present {
		return "absent"
	}
	return quote(s.value)
}

var kvModel = porcupine.Model{
	Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
		byKey := map[string][]porcupine.Operation{}
		var keys []string
		for _, op := range history {
			k := op.Input.(input).key
			if _, seen := byKey[k]; !seen {
				keys = append(keys, k)
			}
			byKey[k] = append(byKey[k], op)
		}
		// Sorted so the visualization lists keys in a stable order.
		sort.Strings(keys)
		out := make([][]porcupine.Operation, 0, len(keys))
		for _, k := range keys {
			out = append(out, byKey[k])
		}
		return out
	},
	Init: func() interface{} { return state{} },
	Step: func(st, i, o interface{}) (bool, interface{}) {
		ok, next := step(st.(state), i.(input), o.(output))
		return ok, next
	},
	DescribeOperation: describeOp,
	DescribeState:     describeState,
}

// ---- parsing --------------------------------------------------------------------------

var validStatus = map[string]map[string]bool{
	"get":    {"ok": true, "not_found": true, "error": true},
	"put":    {"ok": true, "error": true},
	"append": {"ok": true, "error": true},
	"delete": {"ok": true, "not_found": true, "error": true},
	"cas":    {"ok": true, "mismatch": true, "error": true},
}

func parseRecord(raw json.RawMessage, i int) (Record, error) {
	var r Record
	dec := json.NewDecoder(strings.NewReader(string(raw)))
	// A misspelt field would otherwise silently become "absent" and change the verdict.
	dec.DisallowUnknownFields()
	if err := dec.Decode(&r); err != nil {
		return r, fmt.Errorf("operation %d: %v", i, err)
	}
	bad := func(format string, a ...interface{}) error {
		return fmt.Errorf("operation %d: %s", i, fmt.Sprintf(format, a...))
	}
	statuses, known := validStatus[r.Op]
	switch {
	case !known:
		return r, bad("op %q is not one of get, put, delete, cas, append", r.Op)
	case r.Key == nil:
		return r, bad("no key")
	case r.Call == nil:
		return r, bad("no call time")
	case r.Client < 0:
		return r, bad("negative client id")
	case (r.Return == nil) != (r.Output == nil):
		return r, bad("return and output must both be set (finished) or both be null (pending)")
	case r.Return != nil && *r.Return < *r.Call:
		return r, bad("returns (%d) before it is called (%d)", *r.Return, *r.Call)
	}
	needsValue := r.Op == "put" || r.Op == "append" || r.Op == "cas"
	if needsValue != (r.Value != nil) {
		return r, bad("%s takes %s value", r.Op, map[bool]string{true: "a", false: "no"}[needsValue])
	}
	if r.Op != "cas" && r.Expected != nil {
		return r, bad("only cas takes an expected value")
	}
	if o := r.Output; o != nil {
		if !statuses[o.Status] {
			return r, bad("status %q is not valid for %s", o.Status, r.Op)
		}
		if r.Op == "get" && o.Status == "ok" && o.Value == nil {
			return r, bad("a get that returned ok needs the value read")
		}
		if o.Present != nil && o.Status != "mismatch" {
			return r, bad("present belongs to cas mismatch outputs only")
		}
		if o.Status == "mismatch" && o.Present != nil && !*o.Present && o.Value != nil && *o.Value != "" {
			return r, bad("a mismatch on an absent key carries no value")
		}
	}
	return r, nil
}

func toOperation(r Record, end int64) porcupine.Operation {
	in := input{op: r.Op, key: *r.Key}
	if r.Value != nil {
		in.value = *r.Value
	}
	if r.Expected != nil {
		in.hasExp, in.expected = true, *r.Expected
	}
	out := output{pending: r.Output == nil}
	ret := end
	if r.Output != nil {
		ret = *r.Return
		out.status = r.Output.Status
		if r.Output.Value != nil {
			out.value = *r.Output.Value
		}
		if out.status == "mismatch" && r.Output.Present != nil {
			out.hasCur, out.present = true, *r.Output.Present
		}
	}
	return porcupine.Operation{ClientId: r.Client, Input: in, Call: *r.Call, Output: out, Return: ret}
}

func load(data []byte) ([]porcupine.Operation, int, error) {
	var raws []json.RawMessage
	trimmed := strings.TrimSpace(string(data))
	if strings.HasPrefix(trimmed, "[") {
		if err := json.Unmarshal(data, &raws); err != nil {
			return nil, 0, err
		}
	} else {
		var h historyFile
		dec := json.NewDecoder(strings.NewReader(trimmed))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&h); err != nil {
			return nil, 0, err
		}
		if h.Operations == nil {
			return nil, 0, errors.New(`no "operations" list`)
		}
		raws = h.Operations
	}
	recs := make([]Record, len(raws))
	var end int64
	for i, raw := range raws {
		r, err := parseRecord(raw, i)
		if err != nil {
			return nil, 0, err
		}
		recs[i] = r
		for _, t := range []*int64{r.Call, r.Return} {
			if t != nil && *t >= end {
				end = *t + 1
			}
		}
	}
	ops := make([]porcupine.Operation, len(recs))
	pending := 0
	for i, r := range recs {
		// Porcupine's convention for an op that never returned: it returns after
		// every other event, with an output the model accepts whatever happened.
		ops[i] = toOperation(r, end)
		if r.Output == nil {
			pending++
		}
	}
	return ops, pending, nil
}

// ---- main -----------------------------------------------------------------------------

type verdict struct {
	Result     string   `json:"result"` // Ok, Illegal, Unknown (Porcupine's CheckResult)
	Operations int      `json:"operations"`
	Pending    int      `json:"pending"`
	Keys       int      `json:"keys"`
	BadKeys    []string `json:"bad_keys"` // Illegal: the keys whose own history is illegal
	HTML       string   `json:"html,omitempty"`
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("lincheck", flag.ContinueOnError)
	fs.SetOutput(stderr)
	html := fs.String("html", "", "write Porcupine's HTML visualization to this file")
	timeout := fs.Duration("timeout", 0, "give up after this long (0: no limit); exit 3")
	asJSON := fs.Bool("json", false, "print the verdict as one JSON object")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: lincheck [-html out.html] [-timeout 30s] [-json] history.json|-")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return 2
	}
	var data []byte
	var err error
	if fs.Arg(0) == "-" {
		data, err = io.ReadAll(os.Stdin)
	} else {
		data, err = os.ReadFile(fs.Arg(0))
	}
	if err != nil {
		fmt.Fprintf(stderr, "lincheck: %v\n", err)
		return 2
	}
	ops, pending, err := load(data)
	if err != nil {
		fmt.Fprintf(stderr, "lincheck: bad history: %v\n", err)
		return 2
	}

	var res porcupine.CheckResult
	var info porcupine.LinearizationInfo
	if *html != "" {
		res, info = porcupine.CheckOperationsVerbose(kvModel, ops, *timeout)
	} else {
		res = porcupine.CheckOperationsTimeout(kvModel, ops, *timeout)
	}
	parts := kvModel.Partition(ops)
	v := verdict{Result: string(res), Operations: len(ops), Pending: pending, Keys: len(parts), BadKeys: []string{}}
	if res == porcupine.Illegal {
		// Name the culprit keys: a history is linearizable iff every key's is.
		for _, p := range parts {
			if porcupine.CheckOperationsTimeout(kvModel, p, *timeout) == porcupine.Illegal {
				v.BadKeys = append(v.BadKeys, p[0].Input.(input).key)
			}
		}
	}
	if *html != "" {
		if err := porcupine.VisualizePath(kvModel, info, *html); err != nil {
			fmt.Fprintf(stderr, "lincheck: writing %s: %v\n", *html, err)
			return 2
		}
		v.HTML = *html
	}

	if *asJSON {
		b, _ := json.Marshal(v)
		fmt.Fprintln(stdout, string(b))
	} else {
		word := map[porcupine.CheckResult]string{
			porcupine.Ok:      "linearizable",
			porcupine.Illegal: "NOT linearizable",
			porcupine.Unknown: "unknown (timed out)",
		}[res]
		fmt.Fprintf(stdout, "%s: %d operations (%d pending) on %d keys\n", word, v.Operations, v.Pending, v.Keys)
		if len(v.BadKeys) > 0 {
			q := make([]string, len(v.BadKeys))
			for i, k := range v.BadKeys {
				q[i] = quote(k)
			}
			fmt.Fprintf(stdout, "keys with no linearization: %s\n", strings.Join(q, ", "))
		}
		if v.HTML != "" {
			fmt.Fprintf(stdout, "visualization: %s\n", v.HTML)
		}
	}
	switch res {
	case porcupine.Ok:
		return 0
	case porcupine.Illegal:
		return 1
	}
	return 3
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}
